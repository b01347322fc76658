"""How many examples a property test runs: all of them, or a share under the sanitizers.

``scripts/asan-native.sh`` runs the native tests on builds three to five times slower and
sets ``KVWIRE_EXAMPLES_SCALE`` (0.3), so that its slowest properties take a share of their
examples there; the optimised build, in the main run, always takes the full count.
"""

from __future__ import annotations

import os

SCALE = float(os.environ.get("KVWIRE_EXAMPLES_SCALE", "1"))
if not 0 < SCALE <= 1:
    raise ValueError(f"KVWIRE_EXAMPLES_SCALE must be in (0, 1], got {SCALE}")


def examples(n: int) -> int:
    """``n``, scaled by ``KVWIRE_EXAMPLES_SCALE``, and never below 20 (or ``n`` if smaller)."""
    return n if SCALE == 1 else max(min(n, 20), round(n * SCALE))
