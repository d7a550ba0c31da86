"""``python -m cim_int4.bench``: the same as ``cim-int4 bench``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
