"""The connector's block moves, off vLLM's forward thread: one mover thread per engine, shared by both halves.

The worker side submits each step's copies (vLLM block <-> the host tier's slot) and returns at once; the mover thread
runs them (memcpy runs, the GIL released) one batch after another, in submission order. Every job ends in exactly one reported state, done or
failed, which both halves read here (they live in one process for a one-rank engine, as the runtime does):

- the scheduler side `drain()`s finished jobs at its next entry point and seals (saves) or unpins (loads);
- the worker side reports a request to vLLM (`get_finished`) once none of its jobs is in flight: a finished load
  (`finished_recving`), or the delayed free of a finished request whose save was still running (`finished_sending`).

A job whose source may be overwritten before it ran (a preempted request's blocks: vLLM reuses them at once) is
waited for (`wait`) before the forward that may overwrite them; one that cannot be waited for in time is
`poison`-ed: it is reported failed whatever its copy did, so its pages are never sealed.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import structlog

log = structlog.get_logger("kvproc.integrations.vllm")


# vLLM's null block: a sliding window's (or a state group's) placeholder for a page it keeps no block for. Never
# written (it is shared by every request), never read as a page.
NULL_BLOCK = 0


@dataclass
class CopyJob:
    """Block copies of one request in one step, direction given by the batch: page i of the job is the host tier's
    slot `slots[i]` and, in vLLM's KV cache group g, vLLM block `vllm[g][i]` (`NULL_BLOCK`: that group keeps no block
    for the page, e.g. out of a sliding window: not copied)."""

    job_id: int
    req_id: str
    slots: list[int]
    vllm: tuple[list[int], ...]
    # State groups (vLLM's MambaSpec): (vLLM group index, kvproc slot, vLLM block): one state each.
    states: list[tuple[int, int, int]] = field(default_factory=list)
    # A save (`kvproc/store/host_direct.py`): the pages' keys (the slots come with the tier's
    # ticket, on the mover thread), the page before them, and the state groups whose checkpoint at the last key it
    # writes (their `states` slot is the ticket's).
    keys: list[bytes] = field(default_factory=list)
    parent: bytes | None = None
    bounded: list[str] = field(default_factory=list)
    tokens: list[int] | None = None  # the pages' token ids, for a tier whose KV events carry them
    # A load: the leased slots' generations and when the lease was taken (checked after the copy:
    # `HostDirect.intact`).
    gens: list[int] = field(default_factory=list)
    leased_at: float = 0.0
    epoch: int = 0  # the tier attachment the lease is of (a replaced tier's slots are not the lease's)
    # Tensor parallel (`tp.py`): each rank's part, picked by its worker: a load's slots and their generations in that
    # rank's tier, a save's reserved slots and fence there (`tp.RankSave`).
    rank_slots: list[list[int]] = field(default_factory=list)
    rank_gens: list[list[int]] = field(default_factory=list)
    rank_states: list[list[tuple[int, int, int]]] = field(default_factory=list)  # a load's `states`, by rank
    rank_saves: list[Any] = field(default_factory=list)
    rank_epochs: list[int] = field(default_factory=list)  # a load's: the tier attachment each rank's lease is of
    # A save planned in the step of this request's synchronous load (`loads="sync"`): its pages were computed by a
    # forward over the loaded ones, so it runs only if that load succeeded (else vLLM recomputes them, and the pages
    # in vLLM's blocks were computed over unwritten KV: never saved). The mover runs the load first (one thread).
    after: "CopyJob | None" = None
    ok: bool | None = None  # set when the job settled (`MoveQueue._finish`)

    def vllm_blocks(self) -> set[int]:
        """The vLLM blocks this job writes when it is a load (what vLLM must recompute if it fails)."""
        return {b for ids in self.vllm for b in ids if b != NULL_BLOCK} | {b for _, _, b in self.states}


class MoveQueue:
    """Runs `run(jobs, to_vllm)` (raises on failure) for each submitted batch on one thread; tracks every job."""

    def __init__(self, run: Callable[[list[CopyJob], bool], None]) -> None:
        self._run = run
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvproc-mover")
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._inflight: dict[int, CopyJob] = {}
        self._by_req: dict[str, set[int]] = {}
        self._completed: list[tuple[int, bool]] = []  # (job id, ok), not yet drained by the scheduler side
        self._poisoned: set[int] = set()
        self._load_errors: set[int] = set()  # vLLM blocks a failed load left unwritten (vLLM recomputes them)
        self._failed_loads: set[str] = set()  # ... and their requests (the hybrid form of the report: vLLM's block
        # ids of several groups do not name a request's blocks alone)
        self._delayed: set[str] = set()  # requests whose free vLLM delays until their save settles
        self._closed = False
        self.failures = 0  # batches that failed (all time)
        self.busy_s = 0.0  # the mover thread's time in moves (benchmarks)
        self._failing = False  # the last batch failed: later failures are not logged again until one succeeds

    # ---- worker side ----

    def submit(self, jobs: list[CopyJob], to_vllm: bool) -> None:
        if not jobs:
            return
        with self._lock:
            for j in jobs:
                self._inflight[j.job_id] = j
                self._by_req.setdefault(j.req_id, set()).add(j.job_id)
            closed = self._closed
        if closed:
            self._finish(jobs, to_vllm, False)
            return
        self._pool.submit(self._execute, jobs, to_vllm)

    def _execute(self, jobs: list[CopyJob], to_vllm: bool) -> None:
        doomed = self._after_failed_loads(jobs)
        if doomed:  # their load failed: what the forward computed over it is not saved
            log.warning("kvproc_saves_after_failed_load", reqs=sorted({j.req_id for j in doomed}))
            self._finish(doomed, to_vllm, False)
            jobs = [j for j in jobs if j not in doomed]
            if not jobs:
                return
        t0 = time.perf_counter()
        try:
            self._run(jobs, to_vllm)
            ok = True
        except Exception as e:  # noqa: BLE001 - a failed copy is a miss (load) or a lost save, never a crash
            ok = False
            # Said once per outage (a dead copy worker fails every batch until it is restarted), then counted.
            if not self._failing:
                log.error("kvproc_moves_failing", to_vllm=to_vllm, jobs=len(jobs), error=repr(e),
                          effect="loads recomputed by vLLM, saves lost; retried with every step's moves")
            self._failing = True
            self.failures += 1
        self.busy_s += time.perf_counter() - t0
        if ok and self._failing:
            self._failing = False
            log.info("kvproc_moves_recovered", failed_batches=self.failures)
        self._finish(jobs, to_vllm, ok)

    @staticmethod
    def _after_failed_loads(jobs: list[CopyJob]) -> list[CopyJob]:
        """Saves whose synchronous load (`CopyJob.after`) did not succeed (not settled counts as failed: the mover's
        one thread ran it first, so only a poisoned one is still unsettled)."""
        return [j for j in jobs if j.after is not None and j.after.ok is not True]

    def _finish(self, jobs: list[CopyJob], to_vllm: bool, ok: bool) -> None:
        with self._lock:
            for j in jobs:
                good = ok and j.job_id not in self._poisoned
                j.ok = good
                self._poisoned.discard(j.job_id)
                self._inflight.pop(j.job_id, None)
                ids = self._by_req.get(j.req_id)
                if ids is not None:
                    ids.discard(j.job_id)
                    if not ids:
                        del self._by_req[j.req_id]
                if not good and to_vllm:
                    self._load_errors.update(j.vllm_blocks())
                    self._failed_loads.add(j.req_id)
                self._completed.append((j.job_id, good))
            self._idle.notify_all()

    def wait(self, job_ids: Iterable[int], timeout: float) -> bool:
        """Until none of `job_ids` is in flight; False (and those still in flight poisoned) at `timeout`."""
        ids = set(job_ids)
        end = time.monotonic() + timeout
        with self._lock:
            while True:
                left = ids & self._inflight.keys()
                if not left:
                    return True
                rest = end - time.monotonic()
                if rest <= 0:
                    self._poisoned |= left
                    log.error("kvproc_move_wait_timed_out", jobs=sorted(left), timeout_s=timeout)
                    return False
                self._idle.wait(rest)

    def wait_any(self, req_ids: set[str], timeout: float) -> bool:
        """Until one of `req_ids` has no move in flight (True), or `timeout` passed (False)."""
        end = time.monotonic() + timeout
        with self._lock:
            while all(r in self._by_req for r in req_ids):
                rest = end - time.monotonic()
                if rest <= 0:
                    return False
                self._idle.wait(rest)
            return True

    def in_flight(self) -> int:
        with self._lock:
            return len(self._inflight)

    def busy(self, req_id: str) -> bool:
        with self._lock:
            return req_id in self._by_req

    def take_load_errors(self) -> set[int]:
        with self._lock:
            out, self._load_errors = self._load_errors, set()
            return out

    def take_failed_loads(self) -> set[str]:
        with self._lock:
            out, self._failed_loads = self._failed_loads, set()
            return out

    def delayed_among(self, req_ids: Iterable[str]) -> set[str]:
        """Those of `req_ids` (requests vLLM just finished) whose free vLLM delays for a save of theirs."""
        with self._lock:
            return {r for r in req_ids if r in self._delayed}

    def settled(self, req_ids: Iterable[str]) -> set[str]:
        """Those of `req_ids` with no move in flight; delayed frees among them are forgotten (reported once)."""
        with self._lock:
            done = {r for r in req_ids if r not in self._by_req}
            self._delayed -= done
            return done

    # ---- scheduler side ----

    def delay_free(self, req_id: str) -> None:
        with self._lock:
            self._delayed.add(req_id)

    def drain(self) -> list[tuple[int, bool]]:
        with self._lock:
            out, self._completed = self._completed, []
            return out

    def take_outcome(self, job_id: int) -> bool | None:
        """One settled job's outcome, taken out of what `drain` returns (None: not settled)."""
        with self._lock:
            for i, (jid, ok) in enumerate(self._completed):
                if jid == job_id:
                    del self._completed[i]
                    return ok
            return None

    def idle(self, timeout: float) -> bool:
        """Until nothing is in flight (shutdown: the last saves land before the store closes)."""
        end = time.monotonic() + timeout
        with self._lock:
            while self._inflight:
                rest = end - time.monotonic()
                if rest <= 0:
                    return False
                self._idle.wait(rest)
            return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True)
