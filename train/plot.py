"""`python -m train.plot` (older docs): the same as `python -m train.run.plot`, kept so old
commands work."""

import sys

from .run.plot import main

if __name__ == "__main__":
    sys.exit(main())
