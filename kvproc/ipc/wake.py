"""A wake-up fd: other threads hand work to a socket-owning thread through a queue, then wake it with this.

An eventfd is pollable by `zmq.Poller` next to the socket, so the owner thread sleeps in one poll call and never spins.
The lock makes `close()` safe against a concurrent `wake()`: a write must never land on a recycled fd number.
"""

from __future__ import annotations

import os
import threading


class Waker:
    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._lock = threading.RLock()  # re-entrant: a signal handler may wake from the owner thread

    def wake(self) -> None:
        with self._lock:
            if self.fd < 0:
                return
            try:
                os.eventfd_write(self.fd, 1)
            except OSError:  # counter saturated (the owner is already due to wake) or closed mid-signal
                pass

    def drain(self) -> None:
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            pass

    def close(self) -> None:
        with self._lock:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
