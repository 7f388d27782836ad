"""`python -m train ...`: see `train.cli`."""
from train.cli import entry

if __name__ == "__main__":
    entry()
