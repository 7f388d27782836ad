"""`python -m train.prepare` (older docs): the same as `python -m train prepare`, kept so old
commands work (`train.data.prepare`)."""

import sys

from .data.prepare import main

if __name__ == "__main__":
    sys.exit(main())
