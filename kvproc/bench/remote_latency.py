"""`kvproc bench remote --latency`: what a remote hit adds to a resolve. Two nodes (two clusters, separate host tiers)
share a loopback Mooncake Store; node A runs each prompt once (its pages are written behind to Mooncake); node B then
resolves each prompt twice, with its device cache dropped before each: first when the pages are only in Mooncake
(B's host tier asks Mooncake, pulls them into its host slots, then the store loads them to the device), then when
they are in B's host tier (a host hit: the same load, without Mooncake). Both resolves move the same pages to the
device, so the difference is the remote tier's: an existence check, the pull, and the extra round trips.

Each pair is measured back to back in one run (same machine load); the rows give the median and p90 of each and
the median of the per-prompt difference.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from kvproc.engine.engine import Engine
from kvproc.engine.models import TinyModel
from kvproc.engine.request import Request
from kvproc.engine.topology import PoolSizes, Topology, make_store, per_page_bytes
from kvproc.store.types import StoreConfig
from kvproc.tiers.mooncake_local import LocalMooncake

SIZES = PoolSizes(device_blocks=256, live_slots=2, staging_slots=8, host_bytes=64 << 20)


def _node(model: str, url: str) -> Topology:
    return make_store("kvproc", model, SIZES, seed=3, processes=True, remote=url,
                      config=StoreConfig(cacheable_pin_fraction=1.0, resolve_deadline_s=30.0))


def _remote(store: Any) -> dict[str, int]:
    return {k[7:]: v for k, v in store.stats()["tier"].items() if k.startswith("remote.")}


def _wait(cond: Any, what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError(what)
        time.sleep(0.01)


def _resolve_s(t: Topology, rid: str, prompt: np.ndarray) -> tuple[float, int]:
    t.store.drop_device_cache(0)
    t0 = time.perf_counter()
    pre = t.store.resolve_prefix_sync(0, rid, prompt)
    took = time.perf_counter() - t0
    host = int(pre.host_tokens)
    pre.hold.release()
    return took, host


def run_latency(mc: LocalMooncake, *, model: str = "dense", prompts: int = 20, prompt_tokens: int = 256
                ) -> dict[str, Any]:
    rng = np.random.default_rng(5)
    batch = [rng.integers(2, 200, prompt_tokens) for _ in range(prompts)]
    with _node(model, mc.url) as a, _node(model, mc.url) as b:
        eng = Engine(a.model, a.store, max_batch=1, chunk_tokens=128, checkpoint_every_pages=2,
                     prefix_cache=a.prefix_cache)
        for i, p in enumerate(batch):
            req = Request.make(f"a{i}", p, 1)
            eng.run([req])
            if req.failed is not None:
                raise RuntimeError(f"node A: {req.failed}")
        a.store.flush_saves(0, 60)
        _wait(lambda: a.store.stats()["tier"]["open_saves"] == 0 and _remote(a.store).get("queued_pages", 1) == 0,
              "node A's write-behind")
        _wait(lambda: _remote(b.store).get("connected") == 1, "node B connected to Mooncake")
        remote_s, host_s = [], []
        tokens = 0
        for i, p in enumerate(batch):
            r, got_r = _resolve_s(b, f"b{i}-remote", p)
            h, got_h = _resolve_s(b, f"b{i}-host", p)
            if got_r == 0 or got_r != got_h:
                raise RuntimeError(f"prompt {i}: remote hit {got_r} tokens, host hit {got_h}: {_remote(b.store)}")
            remote_s.append(r)
            host_s.append(h)
            tokens = got_r
        st = _remote(b.store)
        page_bytes = per_page_bytes(b.model)[0] if isinstance(b.model, TinyModel) else 0
    rs, hs = np.array(remote_s) * 1e3, np.array(host_s) * 1e3
    return {"model": model, "prompts": prompts, "hit_tokens": tokens, "hit_pages": tokens // SIZES.page_tokens,
            "page_bytes": page_bytes, "remote_ms_p50": round(float(np.median(rs)), 3),
            "remote_ms_p90": round(float(np.percentile(rs, 90)), 3), "host_ms_p50": round(float(np.median(hs)), 3),
            "host_ms_p90": round(float(np.percentile(hs, 90)), 3),
            "added_ms_p50": round(float(np.median(rs - hs)), 3),
            "pulls_ok": st.get("pulls_ok", 0), "pulled_pages": st.get("pulled_pages", 0)}
