"""`python -m train.export` (older docs): the same as `python -m train export`, kept so old
commands work (`train.hf.export`)."""

import sys

from .hf.export import main

if __name__ == "__main__":
    sys.exit(main())
