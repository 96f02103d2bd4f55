"""Prefill/decode disaggregation over kvproc: a router that sends each turn to a prefill engine, then its hand-off
envelope to a decode engine, and engine processes for `kvproc demo --pd`.

`PdRouter` looks like an engine (`submit` / `step` / `has_work`), so the workload driver runs it unchanged. The two
engines may be in-process `Engine`s (tests) or `EngineProcess` proxies (the demo: each engine is its own scheduler
process with its own copy worker, and both share one host tier started with `kvproc up`).

A hand-off the store did not deliver whole (a stalled tier, a lost save) is computed by the decode engine itself
(`Engine(short_handoff="recompute")`, the default: counted `handoffs_recomputed`, the turn's `handoff_recomputed`);
a decode engine that rejects it instead (`short_handoff="reject"`) has the turn retried through prefill
(`max_retries`). A fingerprint mismatch or any other failure fails the turn with both engines' reasons.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections import Counter
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Protocol

from kvproc.engine.request import Request
from kvproc.ipc.segment import sweep_dead_segments


class EngineLike(Protocol):
    def submit(self, req: Request) -> None: ...

    def step(self) -> list[Request]: ...

    @property
    def has_work(self) -> bool: ...


@dataclass
class _Turn:
    user: Request
    attempts: int = 0


class PdRouter:
    def __init__(self, prefill: EngineLike, decode: EngineLike, *, max_retries: int = 1) -> None:
        self.prefill, self.decode = prefill, decode
        self.max_retries = max_retries
        self._turns: dict[str, _Turn] = {}
        self._done: list[Request] = []
        self.counters: Counter[str] = Counter()
        self.clock = time.perf_counter

    @property
    def has_work(self) -> bool:
        return bool(self._turns or self._done)

    def submit(self, req: Request) -> None:
        req.submitted_at = self.clock()
        self._turns[req.req_id] = _Turn(req)
        self._to_prefill(self._turns[req.req_id])

    def _to_prefill(self, t: _Turn) -> None:
        t.attempts += 1
        self.prefill.submit(Request.make(f"{t.user.req_id}@p{t.attempts}", t.user.prompt, 1, handoff_out=True,
                                         stop_on_eos=t.user.stop_on_eos))

    def step(self) -> list[Request]:
        if self.prefill.has_work:
            for p in self.prefill.step():
                self._after_prefill(p)
        if self.decode.has_work:
            for d in self.decode.step():
                self._after_decode(d)
        done, self._done = self._done, []
        return done

    def _user(self, sub_id: str) -> _Turn:
        return self._turns[sub_id.rsplit("@", 1)[0]]

    def _after_prefill(self, p: Request) -> None:
        t = self._user(p.req_id)
        if p.failed is not None or p.envelope is None:
            self._finish(t, failed=f"prefill: {p.failed or 'no envelope'}")
            return
        if t.user.first_token_at is None:
            t.user.first_token_at = self.clock()  # the anchor is the turn's first token
        t.user.device_hit_tokens = p.device_hit_tokens
        t.user.host_hit_tokens = p.host_hit_tokens
        d = Request.make(f"{t.user.req_id}@d{t.attempts}", t.user.prompt, t.user.max_output_tokens,
                         handoff_in=p.envelope, stop_on_eos=t.user.stop_on_eos, keep_logits=t.user.keep_logits)
        try:
            self.decode.submit(d)
        except ValueError as e:  # FingerprintMismatch: the engines cannot exchange KV; no silent recompute
            self.counters["handoffs_rejected"] += 1
            self._finish(t, failed=f"decode intake: {e}")

    def _after_decode(self, d: Request) -> None:
        t = self._user(d.req_id)
        if d.failed is not None:
            self.counters["handoffs_rejected"] += 1
            if d.failed.startswith("handoff: short hit") and t.attempts <= self.max_retries:
                self.counters["handoffs_retried"] += 1
                self._to_prefill(t)
                return
            self._finish(t, failed=f"decode: {d.failed}")
            return
        self.counters["handoffs_completed"] += 1
        if d.handoff_recomputed:  # the decode side computed what the store did not deliver: slower, not failed
            self.counters["handoffs_recomputed"] += 1
            t.user.handoff_recomputed = d.handoff_recomputed
        t.user.output = list(d.output)
        t.user.logits = list(d.logits)
        self._finish(t)

    def _finish(self, t: _Turn, failed: str | None = None) -> None:
        del self._turns[t.user.req_id]
        t.user.failed = failed
        t.user.finished_at = self.clock()
        self._done.append(t.user)


# ---- engine processes (the demo) ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineSpec:
    role: str  # "prefill" | "decode"
    model: str
    device_blocks: int
    live_slots: int
    staging_slots: int
    host_bytes: int
    tier_runtime_dir: str
    page_tokens: int = 16
    seed: int = 0
    chunk_tokens: int = 512
    checkpoint_every_pages: int = 8
    handoff_barrier: bool = False


def engine_process_main(spec: EngineSpec, conn: Connection) -> None:
    """One scheduler process: its own ClusterStore (copy worker) attached to the shared host tier, and an Engine."""
    import setproctitle

    from kvproc.engine.engine import Engine
    from kvproc.engine.models import build_model
    from kvproc.engine.repack import REPACK_PATHS
    from kvproc.runtime.logs import configure_logging
    from kvproc.store.cluster import ClusterStore

    setproctitle.setproctitle(f"kvproc:engine:{spec.role}")
    configure_logging(f"engine-{spec.role}", 0, level="warning")
    with ClusterStore.start(spec.host_bytes, tier_runtime_dir=spec.tier_runtime_dir) as cs:
        model = build_model(spec.model, num_blocks=spec.device_blocks, num_slots=spec.live_slots + spec.staging_slots,
                            page_tokens=spec.page_tokens, seed=spec.seed, allocator=cs.allocator)
        store = cs.attach_model(model, live_slots=spec.live_slots, repack=REPACK_PATHS.get(spec.model))
        engine = Engine(model, store, max_batch=spec.live_slots, chunk_tokens=spec.chunk_tokens,
                        checkpoint_every_pages=spec.checkpoint_every_pages, handoff_barrier=spec.handoff_barrier)
        conn.send(("ready", engine.fingerprint))
        while True:
            while conn.poll(0 if engine.has_work else 0.05):
                kind, payload = conn.recv()
                if kind == "stop":
                    conn.send(("stats", {"engine": engine.stats(), "store": store.stats()["store"]}))
                    return
                try:
                    engine.submit(payload)
                except ValueError as e:
                    payload.failed = str(e)
                    payload.finished_at = time.perf_counter()
                    conn.send(("done", _strip(payload)))
            if engine.has_work:
                for req in engine.step():
                    conn.send(("done", _strip(req)))


def _strip(req: Request) -> Request:
    """What travels back to the router: the request without its (possibly large) prompt."""
    req.prompt = req.prompt[:0]
    return req


class EngineProcess:
    """An engine in its own process, behind a pipe; engine-like for `PdRouter`."""

    def __init__(self, spec: EngineSpec, start_timeout_s: float = 120.0) -> None:
        ctx = mp.get_context("spawn")  # a clean interpreter: no inherited threads, sockets or forkservers
        self._conn, child = ctx.Pipe()
        # Not a daemon: the engine launches its own children (its copy worker). It still dies with us: close()
        # stops it, and its children follow their launcher out.
        self.proc = ctx.Process(target=engine_process_main, args=(spec, child), name=f"engine-{spec.role}")
        self.proc.start()
        child.close()
        self._reaped = False
        if not self._conn.poll(start_timeout_s):
            self.close()
            raise RuntimeError(f"the {spec.role} engine did not come up within {start_timeout_s}s")
        kind, self.fingerprint = self._conn.recv()
        self._inflight: dict[str, Request] = {}
        self._reaped = False
        self.stats: dict[str, Any] = {}

    @property
    def has_work(self) -> bool:
        return bool(self._inflight)

    def submit(self, req: Request) -> None:
        self._inflight[req.req_id] = req
        self._conn.send(("submit", req))

    def step(self) -> list[Request]:
        out = []
        try:
            if self._conn.poll(0.005):
                while self._conn.poll(0):
                    kind, got = self._conn.recv()
                    if kind == "done":
                        mine = self._inflight.pop(got.req_id)
                        got.prompt = mine.prompt
                        out.append(got)
        except (EOFError, OSError):  # the engine is gone: its pipe closed
            self.proc.join(5)
        if not self.proc.is_alive():
            self._reap()
            for req in self._inflight.values():
                req.failed = f"engine process died (exit code {self.proc.exitcode})"
                out.append(req)
            self._inflight.clear()
        return out

    def _reap(self) -> None:
        """A dead engine cannot unlink its arena segments: sweep the ones its pid owns (its leases on the shared
        tier are reclaimed by the tier's TTL, counted there)."""
        if self.proc.pid is not None and not self._reaped:
            self._reaped = True
            sweep_dead_segments(pids=[self.proc.pid])

    def close(self, timeout: float = 30.0) -> None:
        if self.proc.is_alive():
            try:
                self._conn.send(("stop", None))
                if self._conn.poll(timeout):
                    kind, self.stats = self._conn.recv()
            except (BrokenPipeError, EOFError, OSError):
                pass
            self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        self._reap()
        self._conn.close()
