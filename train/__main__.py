"""`python -m train ...` (installed: `python -m relaymoe_train`, `relaymoe-train`): see `cli`.

A Ctrl-C while jax and the trainer import (about a second) is recorded, not raised: a
KeyboardInterrupt raised there printed a 40-line traceback (exit status -2), or landed in jax's
garbage-collection callback, which swallowed it, and the command went on. After the import it
ends the command with one line, exit status 130."""

import signal
import sys
import threading

_received: list[int] = []
_held = (
    threading.current_thread() is threading.main_thread()
    and signal.getsignal(signal.SIGINT) is signal.default_int_handler
)
if _held:
    signal.signal(signal.SIGINT, lambda signum, frame: _received.append(signum))
try:
    from .cli import entry
finally:
    if _held:
        signal.signal(signal.SIGINT, signal.default_int_handler)
if _received:
    print("interrupted (SIGINT)", file=sys.stderr, flush=True)
    sys.exit(130)

if __name__ == "__main__":
    entry()
