"""``python -m qshard.train`` (and ``torchrun ... -m qshard.train``): same as ``qshard train``."""

import sys

from qshard.train.cli import main

if __name__ == "__main__":
    sys.exit(main())
