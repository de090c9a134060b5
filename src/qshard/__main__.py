"""``python -m qshard COMMAND ...`` (and ``torchrun ... -m qshard train ...``): same as the
``qshard`` command."""

import sys

from qshard.cli import main

if __name__ == "__main__":
    sys.exit(main())
