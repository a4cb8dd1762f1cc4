"""Instrumentation the agreements record into: what each collective cost, and the
structured-trace artifacts' plain data.

* ``timing``: per-kind samples, a per-rank Chrome trace, the exit summary;
* ``artifacts``: the JSON of the ``compiler_collective`` artifact and its log
  line, built from ``LocalState`` alone.

A layer just above the base modules (``config``, ``errors``, ``state``,
``stats``, ``version``): it imports nothing else of ours, so every layer may
record into it. The command-line tools that read what it wrote live at the
top, in ``tools/``.
"""
