"""Example counts of the hypothesis tests that `test_native`'s pure-Python pass runs a second time.

That pass (`KVPROC_PURE_PYTHON=1`, a pytest child of the main run) re-runs these files on the numpy fallback, a few
times slower per example; the same CI run has run these properties with their full counts on the compiled module,
and `tests/native` checks the compiled ops against the Python ones on its own examples. In that pass a third of each
count, never under 25 examples (nor above the count itself): every property and state machine still drives the
fallback through all of its rules, for ~10 s less on a 2-core CI machine (20.5 s -> 9.7 s).
"""

from __future__ import annotations

import os

PURE_PASS = os.environ.get("KVPROC_PURE_PYTHON") == "1"


def examples(n: int) -> int:
    """`n` in a normal run; in the pure-Python pass n // 3, at least 25 (at most n)."""
    return min(n, max(25, n // 3)) if PURE_PASS else n
