"""What people and PT2's tooling see: timing and Chrome traces, structured-trace
artifacts, the ``report`` and ``doctor`` commands, and the command line."""
