"""``python -m compiler_collectives``: see ``compiler_collectives.tools.cli``."""

import sys

from compiler_collectives.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
