"""``python -m memguard_bench``: the same as ``memguard bench``."""

import sys

from .cli import main

sys.exit(main())
