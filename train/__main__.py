"""`python -m train ...` (installed: `python -m relaymoe_train`, `relaymoe-train`): see `cli`."""

from .cli import entry

if __name__ == "__main__":
    entry()
