"""Shared setup of the unit tests: make the repository root importable (memguard_core and the
adapters) when the package is not installed, whatever pytest's import mode."""

import os
import sys
import tempfile

# Guarded runs in the tests record into the calibration store: keep that out of the user's data dir,
# or after 3 repeated runs a correction factor would start changing the tests' own plans.
os.environ.setdefault("MEMGUARD_DATA_DIR", tempfile.mkdtemp(prefix="memguard-test-data-"))

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
