"""An order's engine fence (`after_event`: the CUDA IPC handle of the event the engine recorded after the step that
wrote the bytes the order reads): the one place an executor turns it into a wait, or refuses it.

On a mover that can wait on a CUDA event (`fenced`: the cuda mover, `kvproc/workers/cuda_mover.py`) the order runs
inside `mover.fenced(handle, saves)`: its stream waits on the engine's event on the GPU, never the CPU. Any other
mover moves host memory, where a CUDA event orders nothing: the order is refused whole before a byte moves or a fence
word is claimed (`EngineEventError`, code `event_unsupported`), never run as if the handle were not there. A handle
the cuda mover cannot open refuses the order as `bad_event`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from kvproc.workers.movers import MoveError, Mover


class EngineEventError(RuntimeError):
    """An order's engine event cannot be waited on; `code` is the copy worker's reply code: `event_unsupported`
    (host-memory arenas) or `bad_event` (the handle did not open)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@contextlib.contextmanager
def engine_fence(mover: Mover, handle: bytes | None, saves: bool, what: str) -> Iterator[None]:
    """Run the order's body after the engine's event (`saves`: on the save stream, else the load stream); no
    handle: nothing at all. `what` names the order in the refusal (e.g. "save order of request 'a'")."""
    if handle is None:
        yield
        return
    fenced = getattr(mover, "fenced", None)
    if fenced is None:
        raise EngineEventError(
            "event_unsupported",
            f"{what} carries an engine event handle (after_event, {len(handle)} B), but this copy worker moves host "
            f"memory (mover {mover.name!r}): a CUDA event orders nothing here, so the order is refused. Only an "
            "engine whose arenas are on a GPU gives a step fence (KvStore step_fence: None on the CPU)")
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(fenced(handle, saves))
        except MoveError as e:
            raise EngineEventError("bad_event", f"{what}: {e}") from None
        yield
