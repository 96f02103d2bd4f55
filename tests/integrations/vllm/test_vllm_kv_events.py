"""The connector turns on its host tier's KV events (`kv_connector_extra_config`: `kv_events`, `kv_events_tokens`,
`kv_events_interval_ms`): a real vLLM engine (CPU) serves prompts, and a subscriber reading the endpoint the
cluster's manifest names gets a BlockStored (medium "CPU", vLLM's block size) for every full page vLLM computed,
with the page's token ids. kvproc publishes no device-pool stream (it caches nothing in the engine); vLLM's own
GPU blocks are vLLM's `kv_events_config` (docs/vllm.md). With `kv_events_into_vllm` the tier's events are in vLLM's
own stream too, beside its GPU blocks, once each and in the tier's order (`event_forward.py`)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from kvproc.integrations.vllm.runtime import kv_event_endpoints
from kvproc.runtime import manifest as mf
from kvproc.tiers.kv_events import AllBlocksCleared, BlockStored, decode_batch
from tests.conftest import replay_kv_events, wait_for
from tests.integrations.vllm.conftest import (
    BLOCK,
    engine,
    generate,
    kvproc_transfer_config,
    live_runtime,
    random_tokens,
)

pytestmark = pytest.mark.timeout(600)


def _vllm_stream(replay_endpoint: str) -> list[Any]:
    """Every event vLLM's own publisher still holds (its replay endpoint), decoded as vLLM decodes them."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch as VllmBatch

    dec = msgspec.msgpack.Decoder(VllmBatch)
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(replay_endpoint)
    try:
        s.send_multipart([b"", (0).to_bytes(8, "big")])
        out: list[Any] = []
        while True:
            assert s.poll(10_000), "vLLM's replay did not answer"
            _, _, seq, payload = s.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                return out
            out += dec.decode(payload).events
    finally:
        s.close()


def test_the_connectors_host_tier_publishes_every_saved_page_with_its_tokens(tiny_llama: Path, tmp_path: Path) -> None:
    # vLLM's own KV events on too, and the tier's forwarded into vLLM's stream (`kv_events_into_vllm`)
    extra = {"kv_events": True, "kv_events_tokens": True, "kv_events_interval_ms": 10, "kv_events_into_vllm": True}
    kec = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{tmp_path}/vllm-events",
           "replay_endpoint": f"ipc://{tmp_path}/vllm-events-replay"}
    with engine(tiny_llama, kvproc_transfer_config(**extra), kv_events_config=kec) as llm:
        rd = live_runtime().cluster.cluster.runtime_dir
        (tier,) = kv_event_endpoints(rd).values()  # what the connector logs at start (`vllm_connector_started`)
        assert tier["kv_events_interval_ms"] == "10" and tier["kv_events_tokens"] == "1"
        assert mf.read_manifest(rd).published == {}  # no device-pool stream
        rng = random.Random(5)
        prompts = [random_tokens(rng, 100) for _ in range(3)]
        outs = generate(llm, prompts, max_tokens=16)
        # the pages in vLLM's KV: a request's tokens but its last (sampled, never computed); 115 tokens: 3 pages
        pages = {tuple(s[k * BLOCK:(k + 1) * BLOCK]) for p, o in zip(prompts, outs)
                 for s in [p + o[:-1]] for k in range(len(s) // BLOCK)}
        assert len(pages) == 9

        def stored() -> list[BlockStored]:
            return [e for _, b in replay_kv_events(tier["kv_events_replay"]) for e in decode_batch(b).events
                    if isinstance(e, BlockStored)]

        # saves land after the requests finish (asynchronously): wait for all nine pages' events
        wait_for(lambda: sum(len(e.block_hashes) for e in stored()) >= 9, timeout=120, what="every page's event")
        batches = [decode_batch(b) for _, b in replay_kv_events(tier["kv_events_replay"])]
        assert isinstance(batches[0].events[0], AllBlocksCleared)
        got: set[tuple[int, ...]] = set()
        for e in stored():
            assert e.medium == "CPU" and e.block_size == BLOCK
            assert len(e.token_ids) == BLOCK * len(e.block_hashes)
            got |= {tuple(e.token_ids[i:i + BLOCK]) for i in range(0, len(e.token_ids), BLOCK)}
        assert got == pages
        # The same pages in vLLM's own stream, beside its GPU blocks: forwarded at the scheduler's next step (an
        # idle engine has none), so one more request makes one; not the tier's AllBlocksCleared (it would clear the
        # GPU blocks too, for a router)
        generate(llm, [random_tokens(rng, 8)], max_tokens=1)

        def forwarded() -> list[Any]:
            return [e for e in _vllm_stream(kec["replay_endpoint"]) if getattr(e, "medium", None) == "CPU"]

        wait_for(lambda: sum(len(e.block_hashes) for e in forwarded() if type(e).__name__ == "BlockStored") >= 9,
                 timeout=60, what="the tier's pages in vLLM's stream")
        everything = _vllm_stream(kec["replay_endpoint"])
        assert not any(type(e).__name__ == "AllBlocksCleared" for e in everything)
        assert any(getattr(e, "medium", None) == "GPU" for e in everything)  # vLLM's own blocks, same stream
        fwd = [e for e in forwarded() if type(e).__name__ == "BlockStored"]
        assert {tuple(e.token_ids[i:i + BLOCK]) for e in fwd for i in range(0, len(e.token_ids), BLOCK)} == pages
        assert [e.block_hashes for e in fwd] == [e.block_hashes for e in stored()]  # the tier's order, once each
