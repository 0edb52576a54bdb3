"""``python -m fastpar.checkpoint``: see ``fastpar.checkpoint.cli``."""

from __future__ import annotations

import sys

from fastpar.checkpoint.cli import main

if __name__ == "__main__":
    sys.exit(main())
