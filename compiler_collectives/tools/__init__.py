"""The command-line tools, on top of every layer: ``cli`` (``python -m
compiler_collectives``), ``doctor`` and ``report``; and ``launch``, which
starts and reaps the processes of our tests, demo and benchmarks. They may
import anything of ours; nothing of ours but the package's ``__main__``
imports them (and the package's ``__init__``, which hands ``doctor`` the
install error it caught)."""
