"""memguard_core: framework-free estimation, planning, probing and monitoring.

Imports no torch, mlx or transformers at import time; the pieces that need one import it
inside the function that uses it.
"""

__version__ = "0.1.0"
