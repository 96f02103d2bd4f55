"""Hands `_native`'s SHA-256 and XXH3 chains (`_digest_chain.c`) the hash functions this process already loaded.

hashlib's `_hashlib` links OpenSSL's libcrypto, and the xxhash package's extension exports `XXH3_128bits`; ctypes
finds both symbols there (a dlopen handle's lookup also searches the library's dependencies), and their addresses
are installed once. Where a symbol is missing (a Python built without OpenSSL, another xxhash build) that family
keeps its per-page Python loop in `kvproc.core.hashing`: same bytes, slower.
"""

from __future__ import annotations

import ctypes
from types import ModuleType


def _address(library_file: str | None, symbol: str) -> int:
    if not library_file:
        return 0
    try:
        return ctypes.cast(getattr(ctypes.CDLL(library_file), symbol), ctypes.c_void_p).value or 0
    except (OSError, AttributeError):
        return 0


def _module_file(name: str) -> str | None:
    try:
        module = __import__(name, fromlist=["_"])
    except ImportError:
        return None
    return getattr(module, "__file__", None)


def install(native: ModuleType) -> frozenset[str]:
    """Install the functions into `native`; returns the families (`HashAlgorithm` values) whose chain runs in C."""
    crypto = _module_file("_hashlib")
    sha = [_address(crypto, f"SHA256_{step}") for step in ("Init", "Update", "Final")]
    xxh = _address(_module_file("xxhash._xxhash"), "XXH3_128bits")
    sha_ok, xxh_ok = native.install_digests(*sha, xxh)
    return frozenset(name for name, ok in (("sha256-128", sha_ok), ("xxh3-128", xxh_ok)) if ok)
