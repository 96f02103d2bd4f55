"""The vLLM connector's SGLang page format (`kvproc/integrations/vllm/sglang_format.py`) against SGLang's own code:
its page keys equal SGLang's storage hash (`get_storage_hash_str`, salted and not), its rows are the pages SGLang's
host pools hold (written into a real pool through the backend's own page copies, then read back per layer, token
and head from the pool's buffer as SGLang's `init_kv_buffer` lays it out), and its page format is the one the backend
derives from the pool (so the two attach to one tier with one fingerprint). No vLLM here: vLLM's blocks are numpy
arrays in vLLM-CPU's block layout, [kv heads][K, V][tokens][head dim] per layer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvproc.integrations.sglang.pages import HostPoolPages
from kvproc.integrations.vllm.sglang_format import PERMUTATIONS, SglangPages, page_chain, namespace_seed
from tests.integrations.sglang.conftest import PAGE, host_pool, kv_at

LAYERS, HEADS, DIM = 3, 2, 8


@pytest.mark.parametrize("layout", sorted(PERMUTATIONS))
def test_vllm_blocks_become_the_pages_sglangs_host_pool_holds(layout: str) -> None:
    pool = host_pool(layout=layout, layers=LAYERS, heads=HEADS, head_dim=DIM, dtype="float32")
    pages = HostPoolPages(pool)
    fmt = SglangPages.for_vllm(layout, [f"model.layers.{i}.self_attn.attn" for i in (2, 0, 1)], HEADS, DIM, DIM, 4,
                               "float32", PAGE)
    assert fmt.format == pages.format  # the tier model, and so the fingerprint, is the backend's
    rng = np.random.default_rng(7)
    blocks = 5
    # vLLM-CPU's per-layer tensor [blocks, heads, tokens, 2 * dim]: per head N rows of K then N rows of V
    vllm = {name: rng.standard_normal((blocks, HEADS, PAGE, 2 * DIM), dtype=np.float32) for name in fmt.layers}
    kv = {name: t.reshape(blocks, -1).view(np.uint8) for name, t in vllm.items()}
    rows = np.zeros((4, fmt.format.page_bytes), dtype=np.uint8)
    ids, slots = [3, 1], [2, 0]
    fmt.to_rows(kv, ids, rows, slots)
    host_pages = [4, 9]  # the pool's pages the rows go to, through the backend's own copy
    off = pages.offsets(torch.tensor([p * PAGE + t for p in host_pages for t in range(PAGE)]), 2)
    for i, slot in enumerate(slots):
        pages.write(rows[slot], off[i])
    for block, hp in zip(ids, host_pages):
        for li, name in enumerate(fmt.layers):
            per_head = vllm[name][block].reshape(HEADS, 2, PAGE, DIM)  # [H][K, V][N][D]
            for t in range(PAGE):
                k, v = kv_at(pool, li, hp * PAGE + t)
                assert np.array_equal(k.numpy().view(np.uint8), per_head[:, 0, t].view(np.uint8)), (layout, name, t)
                assert np.array_equal(v.numpy().view(np.uint8), per_head[:, 1, t].view(np.uint8)), (layout, name, t)
    # and back: the pool's pages, read by the backend, into other vLLM blocks, byte for byte
    back_rows = np.zeros_like(rows)
    for i, slot in enumerate(slots):
        pages.read(off[i], back_rows[slot])
    assert np.array_equal(back_rows, rows)
    out = {name: np.zeros_like(a) for name, a in kv.items()}
    fmt.from_rows(back_rows, slots, out, [0, 4])
    for name in fmt.layers:
        assert np.array_equal(out[name][0], kv[name][3]) and np.array_equal(out[name][4], kv[name][1])
        assert not out[name][[1, 2, 3]].any()


def test_page_keys_are_sglangs_storage_hash() -> None:
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    rng = np.random.default_rng(3)
    for n in (PAGE, 3 * PAGE, 3 * PAGE + 5):
        tokens = [int(t) for t in rng.integers(0, 200_000, n)]
        theirs = get_storage_hash_str(RadixKey(tokens), None, page_size=PAGE)
        assert page_chain(tokens, PAGE, None) == theirs[:n // PAGE]
        salted = get_storage_hash_str(RadixKey(tokens, cache_salt="tenant-a"), None, page_size=PAGE)
        assert page_chain(tokens, PAGE, namespace_seed("tenant-a")) == salted[:n // PAGE]
        assert salted[0] != theirs[0]
    # a chain continued page by page is the chain of the whole prompt
    tokens = list(range(100, 100 + 4 * PAGE))
    first = page_chain(tokens[:PAGE], PAGE, None)
    assert first + page_chain(tokens[PAGE:], PAGE, first[-1]) == page_chain(tokens, PAGE, None)
