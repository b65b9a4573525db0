"""Shared setup of the unit tests: make the repository root importable (memguard_core and the
adapters) when the package is not installed, whatever pytest's import mode."""

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
