"""`OpRunner`: blocking calls (a remote store's client library) on a thread of their own, each with a deadline and
exactly one terminal outcome.

A library call cannot be cancelled (Mooncake's client retries a dead master for seconds inside one call), so the
deadline is enforced from outside: a watchdog thread ends an op still running at its deadline with `TIMEOUT`, and the
call's real result, when it comes, goes to the op's `on_late` (so resources the call still uses, like the slots it
reads or writes, are given back only once it has really ended). Outcomes: `OK` (the call returned), `FAILED` (it
raised), `TIMEOUT`, `CLOSED` (the runner stopped before the op ran). Ops run one at a time, in submission order.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import structlog

log = structlog.get_logger("kvproc.deadline_ops")

OK, FAILED, TIMEOUT, CLOSED = "ok", "failed", "timeout", "closed"

Done = Callable[[str, Any], None]  # (outcome, result or exception)


def _ran() -> None:
    raise RuntimeError("op already ran")


@dataclass(eq=False)
class _Op:
    fn: Callable[[], Any]
    deadline: float  # time.monotonic()
    on_done: Done
    on_late: Done | None
    what: str
    ended: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def end(self, outcome: str, result: Any) -> bool:
        """The op's terminal outcome, once; False if it had one already."""
        with self.lock:
            if self.ended:
                return False
            self.ended = True
        try:
            self.on_done(outcome, result)
        except Exception:  # noqa: BLE001 - a callback's bug must not kill the runner's threads
            log.exception("op_callback_failed", op=self.what, outcome=outcome)
        return True


class OpRunner:
    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: deque[_Op] = deque()
        self._deadlines: list[tuple[float, int, _Op]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self.outcomes: dict[str, int] = {OK: 0, FAILED: 0, TIMEOUT: 0, CLOSED: 0}
        self._worker = threading.Thread(target=self._work, name=f"kvproc-{name}", daemon=True)
        self._watch = threading.Thread(target=self._watchdog, name=f"kvproc-{name}-deadlines", daemon=True)
        self._worker.start()
        self._watch.start()

    def submit(self, fn: Callable[[], Any], timeout: float, on_done: Done, *, on_late: Done | None = None,
               what: str = "op") -> None:
        """Run `fn()` on the runner's thread; `on_done(outcome, result)` is called exactly once (on the runner's
        thread, the watchdog's, or the caller's when the runner is closed)."""
        op = _Op(fn, time.monotonic() + max(timeout, 0.0), on_done, on_late, what)
        with self._cv:
            if not self._closed:
                self._queue.append(op)
                heapq.heappush(self._deadlines, (op.deadline, next(self._seq), op))
                self._cv.notify_all()
                return
        self._end(op, CLOSED, None)

    def call(self, fn: Callable[[], Any], timeout: float, *, on_late: Done | None = None,
             what: str = "op") -> tuple[str, Any]:
        """`submit` and wait for the outcome (at most `timeout`, plus the watchdog's reaction)."""
        got: list[tuple[str, Any]] = []
        ev = threading.Event()

        def done(outcome: str, result: Any) -> None:
            got.append((outcome, result))
            ev.set()

        self.submit(fn, timeout, done, on_late=on_late, what=what)
        ev.wait()
        return got[0]

    def _end(self, op: _Op, outcome: str, result: Any) -> None:
        if op.end(outcome, result):
            self.outcomes[outcome] += 1
            if outcome in (FAILED, TIMEOUT):
                log.warning("remote_op_ended", runner=self.name, op=op.what, outcome=outcome, detail=repr(result))

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                op = self._queue.popleft()
            if op.ended:  # timed out in the queue: never ran
                continue
            if time.monotonic() >= op.deadline:
                self._end(op, TIMEOUT, "deadline passed before the op ran")
                continue
            try:
                outcome, result = OK, op.fn()
            except Exception as e:  # noqa: BLE001 - the op's failure is its outcome
                outcome, result = FAILED, e
            op.fn = _ran  # what it captured is not kept alive by the deadline heap
            if not op.ended:
                self._end(op, outcome, result)
            elif op.on_late is not None:  # the watchdog ended it: the call's real result still goes somewhere
                try:
                    op.on_late(outcome, result)
                except Exception:  # noqa: BLE001
                    log.exception("op_late_callback_failed", op=op.what)

    def _watchdog(self) -> None:
        while True:
            with self._cv:
                now = time.monotonic()
                due = []
                while self._deadlines and self._deadlines[0][0] <= now:
                    due.append(heapq.heappop(self._deadlines)[2])
                if not due:
                    if self._closed and not self._deadlines:
                        return
                    wait = self._deadlines[0][0] - now if self._deadlines else None
                    self._cv.wait(wait)
                    continue
            for op in due:
                if not op.ended:
                    self._end(op, TIMEOUT, "deadline passed")

    def join(self, timeout: float) -> bool:
        """After `close`: wait for the op running now to end; False if it still runs."""
        self._worker.join(timeout)
        return not self._worker.is_alive()

    def close(self) -> None:
        """Stop taking ops; those queued end `CLOSED` (one running still ends on its own, or at its deadline)."""
        with self._cv:
            self._closed = True
            queued, self._queue = list(self._queue), deque()
            self._cv.notify_all()
        for op in queued:
            self._end(op, CLOSED, None)
