"""Puts this checkout's `keras_mp` first on `sys.path`.

Python puts `benchmarks/` on the path, not the repository root, so a script
run from a checkout would otherwise time whatever keras_mp is installed in
the environment, which may be an older copy. Imported for its effect.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
