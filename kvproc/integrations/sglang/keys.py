"""SGLang page keys -> kvproc tier keys, in a namespace of the model identity and the rank's shard.

SGLang's keys name token prefixes only (a SHA-256 chain over the pages' token ids: no model, no rank); each backend
adds its own namespace. kvproc's tier keys are 16-byte digests: BLAKE2b-128 over the namespace and the SGLang key, so
the same prefix of another model, another page format (the tier fingerprint is in the namespace), or another
tensor-parallel shard never names the same page.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from kvproc.integrations.sglang.errors import SglangInputError


def shard_of(config: Any) -> str:
    """The part of SGLang's storage config that tells apart ranks holding different bytes for one page. MLA's
    latent is the same on every TP rank (one copy serves them all), MHA's heads are split across them; pipeline
    stages hold other layers and context-parallel ranks other slices of each page."""
    parts = []
    if not getattr(config, "is_mla_model", False):
        parts.append(f"tp{config.tp_rank}of{config.tp_size}")
    if getattr(config, "pp_size", 1) > 1:
        parts.append(f"pp{config.pp_rank}of{config.pp_size}")
    if getattr(config, "attn_cp_size", 1) > 1:
        parts.append(f"cp{config.attn_cp_rank}of{config.attn_cp_size}")
    if getattr(config, "dcp_size", 1) > 1:
        parts.append(f"dcp{config.dcp_rank}of{config.dcp_size}")
    return ".".join(parts) or "all"


class KeySpace:
    def __init__(self, fingerprint: str, shard: str) -> None:
        self.namespace = f"kvproc-sglang-v1\0{fingerprint}\0{shard}\0".encode()

    def key(self, key: str) -> bytes:
        if not isinstance(key, str) or not key:
            raise SglangInputError(f"a HiCache key must be a non-empty string, got {key!r}")
        h = hashlib.blake2b(self.namespace, digest_size=16)
        h.update(key.encode())
        return h.digest()

    def keys(self, keys: Sequence[str]) -> list[bytes]:
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
            raise SglangInputError(f"keys must be a list of strings, got {type(keys).__name__}")
        return [self.key(k) for k in keys]
