"""Reservations a store gave up on: the tier's side of settling a save whose ticket never reached its store.

Why (issue 39, item 8): a `ReserveSave` sent to a tier that then stalls (SIGSTOP, a paused VM) is still in the
tier's socket when the store's client declares the tier dead and fails the call. When the tier runs again it serves
the request -- its deadline has not passed -- and opens a save nobody will commit or abort: its slots taken, its
pages "Loading" for every engine that queries them, until the save TTL (minutes). The store cannot abort it by save
id: it never learnt it.

So each `ReserveSave` carries a reservation id the store drew (random per store, then counting), and a store whose
reserve call failed, for whatever reason, sends `AbortSave(reservation=id)` (kept and sent again once it is
reconnected to the same tier process, `RemoteTier._replay`). Here:
- a reservation that opened a save (`opened`) is found by its id, and the save aborted (`abandon`);
- an abandon that comes first is remembered (`refuse`), and the reserve, should it still arrive, is refused (shed):
  remembered for the save TTL (a reserve older than that is past its deadline anyway), at most `max_remembered`.
One thread at a time (the tier's lock).
"""

from __future__ import annotations

from typing import Callable


class Reservations:
    def __init__(self, remember_s: float, clock: Callable[[], float], max_remembered: int = 65536) -> None:
        self.remember_s = remember_s
        self.max_remembered = max_remembered
        self._clock = clock
        self._open: dict[int, int] = {}  # reservation id -> the save it opened (while the save is open)
        self._by_save: dict[int, int] = {}  # save id -> its reservation id
        self._abandoned: dict[int, float] = {}  # reservation id -> forget at; by expiry (insertion order)
        self.forgotten_full = 0

    def refuse(self, reservation: int) -> bool:
        """Was this reservation abandoned before it arrived? (The reserve must then open nothing.)"""
        return reservation in self._abandoned

    def opened(self, reservation: int, save_id: int) -> None:
        if reservation:
            self._open[reservation] = save_id
            self._by_save[save_id] = reservation

    def settled(self, save_id: int) -> None:
        """The save committed or was aborted (by id, by its TTL): its reservation is no longer needed."""
        reservation = self._by_save.pop(save_id, None)
        if reservation is not None:
            self._open.pop(reservation, None)

    def abandon(self, reservation: int) -> int | None:
        """The store gave up on `reservation`: the save it opened (to abort), or None -- then it is remembered, and
        refused if it still comes."""
        save_id = self._open.pop(reservation, None)
        if save_id is not None:
            self._by_save.pop(save_id, None)
            return save_id
        if reservation not in self._abandoned and len(self._abandoned) >= self.max_remembered:
            del self._abandoned[next(iter(self._abandoned))]  # the oldest: the least likely still to arrive
            self.forgotten_full += 1
        self._abandoned.pop(reservation, None)
        self._abandoned[reservation] = self._clock() + self.remember_s
        return None

    def prune(self, alive: Callable[[int], bool]) -> None:
        """Forget the open entries whose id ended without `settled` (a lease the TTL reclaimed)."""
        for reservation, opened_id in [(r, i) for r, i in self._open.items() if not alive(i)]:
            del self._open[reservation]
            self._by_save.pop(opened_id, None)

    def expire(self) -> None:
        now, abandoned = self._clock(), self._abandoned
        while abandoned and (first := next(iter(abandoned.items())))[1] <= now:
            del abandoned[first[0]]

    @property
    def remembered(self) -> int:
        return len(self._abandoned)
