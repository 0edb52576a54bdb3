"""``python -m fastpar.train``."""

import sys

from fastpar.train.cli import main

sys.exit(main())
