"""`TierSlots`: a host tier's segment mapped by a process that copies pages in and out of its slots itself.

The direct path (`host_direct.py`) copies between an engine's own KV blocks and the tier's slots, in the engine's
process. That process may not be the one that talks to the tier: with tensor parallelism vLLM runs each rank's model
in a worker process of its own, while kvproc's store (leases, reservations, commits) lives beside vLLM's scheduler.
The worker then needs only this: the slots as rows of bytes, the save fences, and the slot table's generations, all
in shared memory; everything it is handed (which slots, which fence) comes from the store in a message.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from kvproc.ipc.segment import Segment, SegmentBusyError
from kvproc.tiers import save_fence
from kvproc.tiers.layout import HostLayout
from kvproc.tiers.slot_table import GEN, ROW_BYTES, ROWS
from kvproc.workers.copy_exec import fence_row, host_region

# A lease older than this is not trusted for a copy: the tier's leases live 30 s by default (`kvproc up
# --lease-ttl`), and an engine may hold a request back (no blocks for it) longer than that between its lookup and
# its load. Past it the load is reported failed (the engine recomputes), whatever the slots hold.
LEASE_SAFE_S = 10.0


class TierSlots:
    def __init__(self, segment: str, layout: HostLayout) -> None:
        self.layout = layout
        self._segment = Segment.attach(segment)
        host = self._segment.numpy(np.uint8)
        self._fences = fence_row(host, layout)
        self._gens: np.ndarray | None = None  # each page slot's generation (`kvproc/tiers/slot_table.py`)
        if layout.slot_table_offset >= 0:
            off, n = layout.slot_table_offset, layout.page_slots
            self._gens = host[off: off + ROWS * n * ROW_BYTES].view(np.int64).reshape(ROWS, n)[GEN]
        self.views: dict[str, np.ndarray] = {}  # stored arena -> its slots as [slots, unit bytes] rows
        for r in layout.regions:
            flat = host_region(host, layout, r.arena)
            assert flat is not None
            self.views[r.arena] = flat.reshape(r.slots, r.unit_bytes)
        del host

    def intact(self, slots: Sequence[int], gens: Sequence[int], leased_at: float, now: float) -> bool:
        """After a copy out of leased slots: the lease was young enough to be alive (`LEASE_SAFE_S`), and no save
        was handed one of the slots meanwhile (a save bumps a slot's generation before it may write it). False: the
        bytes copied may be another page's."""
        if now - leased_at > LEASE_SAFE_S:
            return False
        if self._gens is None or not gens:
            return True
        return bool(np.array_equal(self._gens[np.asarray(slots, dtype=np.int64)], np.asarray(gens, dtype=np.int64)))

    def write_fenced(self, fence: int, token: int, write: Callable[[], None]) -> None:
        """Run `write` (into a save's reserved slots) holding the save's fence: raises `FenceRevoked` (nothing
        written) when the tier has taken the slots back already."""
        save_fence.claim(self._fences, fence, token)
        try:
            write()
        finally:
            save_fence.release(self._fences, fence, token)

    def close(self) -> None:
        """Unmap the segment; while a caller still holds a view of it, the mapping stays (freed with the process)
        rather than pull memory from under that view."""
        self.views.clear()
        self._fences = self._gens = None
        try:
            self._segment.close()
        except SegmentBusyError:
            pass
