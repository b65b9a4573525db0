"""``python -m memguard_bench``: the same as ``memguard bench``."""

import sys

from .harness import main

sys.exit(main())
