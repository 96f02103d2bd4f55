"""The optional compiled helpers (`kvproc/native/_native.c`), or None where they are not built or are turned off.

`KVPROC_PURE_PYTHON=1` turns them off (read once, at import): the pure-Python forms give the same results, slower.
It exists for A/B measurements (the same bench with and without it) and for running the tests on the fallback.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType


def _load() -> ModuleType | None:
    try:
        return importlib.import_module("kvproc.native._native")
    except ImportError:  # built without a C compiler: the pure-Python forms
        return None


_native = _load()

NATIVE: ModuleType | None = None if os.environ.get("KVPROC_PURE_PYTHON") == "1" else _native


def _chains() -> frozenset[str]:
    if NATIVE is None:
        return frozenset()
    from kvproc.native.digests import install

    return frozenset({"blake2b-128"}) | install(NATIVE)


# The hash families (`HashAlgorithm` values) whose page chain runs in `NATIVE` (`kvproc.core.hashing`).
NATIVE_CHAINS: frozenset[str] = _chains()


def describe() -> str:
    """One word for logs and bench headers."""
    if NATIVE is not None:
        return "native"
    return "pure-python (turned off)" if _native is not None else "pure-python (not built)"
