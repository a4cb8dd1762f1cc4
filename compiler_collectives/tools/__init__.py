"""The command-line tools, on top of every layer: ``cli`` (``python -m
compiler_collectives``), ``doctor`` and ``report``. They may import anything
of ours below the package; nothing of ours but the package's ``__main__``
imports them (and ``runtime``, the composition root, which hands ``doctor``
the install error it caught). The launcher of our tests, demo and benchmarks
is ``cc_launch``, outside the package."""
