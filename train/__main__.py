"""`python -m train ...` (installed: `python -m relaymoe_train`, `relaymoe-train`): see `cli`.

A Ctrl-C (SIGINT) or SIGTERM while jax and the trainer import (about a second) is recorded, not
acted on there: a KeyboardInterrupt raised there printed a 40-line traceback (exit status -2), or
landed in jax's garbage-collection callback, which swallowed it, and the command went on; SIGTERM
ended the process silently (exit status -15). After the import it ends the command with one line,
`interrupted (SIGINT)` / `interrupted (SIGTERM)`, exit status 130 / 143, as a signal during a run
does (`cli.entry`)."""

import signal
import sys
import threading

# the signals held during the import, and the handler each must have to be held (Python's own)
_DEFAULTS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
_received: list[int] = []
_held = [
    s
    for s, default in _DEFAULTS.items()
    if threading.current_thread() is threading.main_thread() and signal.getsignal(s) is default
]
for _s in _held:
    signal.signal(_s, lambda signum, frame: _received.append(signum))
try:
    from .cli import entry
finally:
    for _s in _held:
        signal.signal(_s, _DEFAULTS[_s])
if _received:
    print(f"interrupted ({signal.Signals(_received[0]).name})", file=sys.stderr, flush=True)
    sys.exit(128 + _received[0])

if __name__ == "__main__":
    entry()
