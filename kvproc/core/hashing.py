"""Chained, position-aware 128-bit content hashes of full pages.

`h_i = H(h_{i-1} || tokens of page i)`, with `h_{-1}` the scope seed (cache salt, LoRA name, extra keys). Equal
hashes mean equal token prefixes *and* equal scope, so a hit can be served; the chain makes every hash position-aware.

Prompts are attacker-controlled: a crafted collision would serve one user's KV to another, so both families a store
uses unless told otherwise are collision-resistant: SHA-256-128 (`DEFAULT_HASH`, the function vLLM hashes its blocks
with) and BLAKE2b-128. XXH3-128 is non-cryptographic and used only when configured explicitly
(`HashAlgorithm.XXH3_128`).
SHA-256 is the default because it is the fastest collision-resistant chain here: OpenSSL's SHA-256 runs on the CPU's
SHA extensions (x86 since Ice Lake / Zen, Arm v8.2), which no BLAKE2b has (bench/RESULTS.md, "Hashing and probing").

Tokens are serialised once per prompt in one C-level call (little-endian int32, so the bytes are the same on every
machine and independent of `PYTHONHASHSEED`). Each page's hash depends on the previous one, so no numpy call can do
the chain: it runs in `kvproc.native._native` where that is built, one C call per prompt without the GIL (per
16-token page, measured on this project's 2-vCPU Xeon: BLAKE2b ~0.16 us, our own RFC 7693 code; SHA-256 ~0.10 us,
OpenSSL's with the CPU's SHA extensions; XXH3 ~0.035 us, the xxhash package's), else as one hashlib / xxhash call per
page (~0.5-1.2 us, most of it call overhead). Both give the same bytes.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import xxhash

from kvproc.native import NATIVE, NATIVE_CHAINS

# A token id outside any vocabulary: pads the partial last page of a P/D hand-off so that every page has a name.
PAD_TOKEN_ID: int = 2**31 - 1

# Version of the hashing layout; part of the seed, so a layout change can never match old hashes.
HASH_LAYOUT_VERSION = 2  # 2: the model identity (namespace) is part of the seed

BlockHash = bytes  # 16 bytes
HASH_BYTES = 16  # every algorithm's page hash: 128 bits


class HashAlgorithm(enum.Enum):
    BLAKE2B_128 = "blake2b-128"  # collision-resistant
    SHA256_128 = "sha256-128"  # collision-resistant, truncated to 128 bits: the default
    XXH3_128 = "xxh3-128"  # fast, NOT collision-resistant: opt-in only


# The family every store's pools hash with unless built with another hasher. Part of the fingerprint: engines that
# exchange KV (a hand-off, a shared tier) must agree on it, so it is one fixed family, never chosen per machine.
DEFAULT_HASH = HashAlgorithm.SHA256_128


def _blake2b(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _sha256(data: bytes | memoryview) -> bytes:
    return hashlib.sha256(data).digest()[:16]


_NATIVE_CHAIN_FN = {HashAlgorithm.BLAKE2B_128: "blake2b_chain", HashAlgorithm.SHA256_128: "sha256_chain",
                    HashAlgorithm.XXH3_128: "xxh3_chain"}

_HASH_FNS: dict[HashAlgorithm, Callable[[bytes], bytes]] = {
    HashAlgorithm.BLAKE2B_128: _blake2b,
    HashAlgorithm.SHA256_128: _sha256,
    HashAlgorithm.XXH3_128: xxhash.xxh3_128_digest,
}


@dataclass(frozen=True)
class HashScope:
    """What must match besides the tokens for KV to be shareable."""

    cache_salt: str = ""
    lora_name: str = ""
    extra_keys: tuple[str, ...] = ()  # e.g. multimodal content hashes

    def encode(self) -> bytes:
        parts = [f"kvproc-hash-v{HASH_LAYOUT_VERSION}", self.cache_salt, self.lora_name, *self.extra_keys]
        # Length-prefix every part so ("ab", "") and ("a", "b") differ.
        return b"".join(len(p.encode()).to_bytes(4, "little") + p.encode() for p in parts)


DEFAULT_SCOPE = HashScope()


# The largest id a user token may have: PAD_TOKEN_ID names a hand-off's padding only (`hash_prompt(pad_tail=True)`),
# so no prompt can name the pages of a producer's padded chain.
MAX_USER_TOKEN_ID: int = PAD_TOKEN_ID - 1


def tokens_to_bytes(tokens: Sequence[int] | np.ndarray, *, max_id: int = MAX_USER_TOKEN_ID) -> bytes:
    """Serialise token ids (validated to lie in [0, max_id]) as little-endian int32 in one vectorised call."""
    if type(tokens) is list:
        if NATIVE is not None:  # one C pass that also range-checks (~3 us for 1,024 tokens)
            try:
                return NATIVE.pack_tokens(tokens, max_id)
            except (TypeError, ValueError):
                pass  # numpy's path below names the problem the same way with or without the module
        # A Python list (what engines pass) packs to uint32 in C ~3x faster than numpy's generic sequence
        # conversion; packing rejects negatives and ids >= 2**32 (struct.error), one reduction the rest.
        try:
            packed = struct.pack(f"<{len(tokens)}I", *tokens)
        except struct.error:
            packed = None  # out of range or not integers: numpy's path below names the problem
        if packed is not None and (not tokens or int(np.frombuffer(packed, "<u4").max()) <= max_id):
            return packed
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > max_id):
        hint = f" ({PAD_TOKEN_ID} is the reserved pad id)" if int(arr.max()) == PAD_TOKEN_ID else ""
        raise ValueError(f"token ids must lie in [0, {max_id}], got min {arr.min()} max {arr.max()}{hint}")
    return arr.astype("<i4", copy=False).tobytes()


class PageHashes(list[BlockHash]):
    """A prompt's chain of page hashes that remembers what it was computed from: the token bytes, scope and hasher.

    `RequestKv(prompt_hashes=...)` takes the resolve's chain instead of hashing the prompt again, and must never index
    one prompt's KV under another prompt's keys (its next reader would be served the wrong KV): it checks the chain
    against its own tokens with `covers`, one byte comparison, instead of trusting the caller. A plain list is
    refused there. The list itself stays a list (index, slice, compare) for every other reader."""

    __slots__ = ("data", "scope", "parent", "hasher_id")

    data: bytes  # the little-endian int32 tokens the chain was computed over (full pages and any tail)
    scope: "HashScope"
    parent: BlockHash | None  # the chain continues another one (None: it starts at the scope's seed)
    hasher_id: tuple[str, str, int]  # (algorithm, namespace, page tokens) of the hasher that made it

    def covers(self, hasher: "BlockHasher", tokens: np.ndarray, scope: "HashScope") -> str | None:
        """None when this chain is the one `hasher` computes for `tokens` under `scope` (every full page), else
        why not."""
        if self.hasher_id != hasher.identity:
            return f"the hashes come from another hasher ({self.hasher_id}, this pool's is {hasher.identity})"
        if self.parent is not None:
            return "the hashes continue another chain (parent=...), they are not a prompt's"
        if self.scope != scope:
            return f"the hashes are of scope {self.scope}, the request's is {scope}"
        full = len(self) * hasher.page_tokens
        if len(self.data) < 4 * full or tokens.size < full:
            return "the hashes cover more tokens than the request has"
        if (NATIVE is not None and tokens.dtype == np.int64
                and NATIVE.tokens_match(self.data, tokens[:full], MAX_USER_TOKEN_ID)):
            return None  # equal and in range, in one C pass: what the comparison below finds, without its copies
        if self.data[: 4 * full] != tokens_to_bytes(tokens[:full]):
            return "the hashes were computed over other tokens than this request's prompt"
        return None


class BlockHasher:
    """Hashes prompts into chains of full-page hashes. Stateless and thread-safe.

    `namespace` is the model identity (`KvSpec.model_id`: weights/checkpoint): it is part of every seed, so two models
    never name a page alike, even with the same tokens and scope."""

    def __init__(self, page_tokens: int, algorithm: HashAlgorithm = DEFAULT_HASH, *,
                 namespace: str = "") -> None:
        if page_tokens <= 0 or page_tokens & (page_tokens - 1):
            raise ValueError(f"page_tokens must be a positive power of two, got {page_tokens}")
        self.page_tokens = page_tokens
        self.algorithm = algorithm
        self.namespace = namespace
        self.identity = (algorithm.value, namespace, page_tokens)
        self._fn = _HASH_FNS[algorithm]
        self._prefix = algorithm.value.encode() + len(namespace.encode()).to_bytes(4, "little") + namespace.encode()
        self._seeds: dict[HashScope, BlockHash] = {}  # scopes are few and frozen: hash each one once
        # The whole chain in one C call where `kvproc.native` has it for this family (all three where it is built
        # and hashlib / xxhash expose their C functions: `kvproc/native/digests.py`), else one hash call per page.
        self._native_chain: Callable[[bytes, int, bytes], list[bytes]] | None = None
        if NATIVE is not None and algorithm.value in NATIVE_CHAINS:
            self._native_chain = getattr(NATIVE, _NATIVE_CHAIN_FN[algorithm])

    def seed(self, scope: HashScope = DEFAULT_SCOPE) -> BlockHash:
        seed = self._seeds.get(scope)
        if seed is None:
            if len(self._seeds) >= 4096:  # per-request salts could grow it without bound
                self._seeds.clear()
            seed = self._seeds[scope] = self._fn(self._prefix + scope.encode())
        return seed

    def hash_prompt(
        self,
        tokens: Sequence[int] | np.ndarray,
        scope: HashScope = DEFAULT_SCOPE,
        *,
        parent: BlockHash | None = None,
        pad_tail: bool = False,
    ) -> PageHashes:
        """Hashes of every full page of `tokens` (a trailing partial page has no hash).

        `parent` continues an existing chain (the hash of the page before `tokens[0]`), which is how a running request
        extends its chain as decode fills pages without rehashing the prompt. Token ids must be user ids (below
        PAD_TOKEN_ID); `pad_tail=True` also admits a trailing run of fewer than a page of PAD_TOKEN_ID (a P/D
        hand-off's padded chain, and nowhere else).
        """
        data = self._pack_padded(tokens) if pad_tail else tokens_to_bytes(tokens)
        page_bytes = 4 * self.page_tokens
        n_pages = len(data) // page_bytes
        h = self.seed(scope) if parent is None else parent
        out = PageHashes()
        out.data, out.scope, out.parent, out.hasher_id = data, scope, parent, self.identity
        chain = self._native_chain
        if chain is not None:
            out.extend(chain(data, page_bytes, h))
            return out
        # One vectorised split into per-page bytes objects (a numpy void dtype), then one loop per family with the
        # hash constructor inlined: a wrapper call per page would cost more than the hash of a 64-byte page itself.
        pages = np.frombuffer(data, dtype=f"V{page_bytes}", count=n_pages).tolist()
        append = out.append
        if self.algorithm is HashAlgorithm.BLAKE2B_128:
            blake2b = hashlib.blake2b
            for page in pages:
                h = blake2b(h + page, digest_size=16).digest()
                append(h)
        elif self.algorithm is HashAlgorithm.SHA256_128:
            sha256 = hashlib.sha256
            for page in pages:
                h = sha256(h + page).digest()[:16]
                append(h)
        else:
            xxh3 = xxhash.xxh3_128_digest
            for page in pages:
                h = xxh3(h + page)
                append(h)
        return out

    def _pack_padded(self, tokens: Sequence[int] | np.ndarray) -> bytes:
        """User tokens followed by at most `page_tokens - 1` pad ids: any other pad id is refused."""
        arr = np.asarray(tokens, dtype=np.int64).reshape(-1)
        n, k = arr.size, 0
        while k < min(self.page_tokens, n) and arr[n - 1 - k] == PAD_TOKEN_ID:
            k += 1
        if k >= self.page_tokens:
            raise ValueError(f"a padded chain pads less than one page ({self.page_tokens} tokens); {k} or more "
                             "trailing pad ids")
        return tokens_to_bytes(arr[: n - k]) + _PAD_BYTES * k

    def floor_hash(self, tokens: Sequence[int] | np.ndarray) -> bytes:
        """One hash call over the whole prompt's bytes: the pure data cost benchmarks compare against."""
        return self._fn(tokens_to_bytes(tokens))


_PAD_BYTES = PAD_TOKEN_ID.to_bytes(4, "little")
