"""`python -m keras_ft ...`: the `keras-ft` command (see `keras_ft/cli.py`)."""

from __future__ import annotations

import sys

from keras_ft.cli import main

if __name__ == "__main__":
    sys.exit(main())
