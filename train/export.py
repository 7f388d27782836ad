"""`python -m train.export` (older docs): the same as `python -m train export`, kept so old
commands work (`train.hf.export`)."""

import sys

from .hf.export import main
from .run.guards import quiet_background_errors

if __name__ == "__main__":
    with quiet_background_errors(keep=True):  # orbax's reads cut short by a signal
        sys.exit(main())
