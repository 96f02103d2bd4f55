"""A count-min sketch of exponentially decayed access counts, keyed by 64-bit content fingerprints.

Why a sketch: the frequency that predicts reuse on the Mooncake trace is a page's history *across* evictions (a
conversation's prefix evicted once still comes back); an exact table of every key ever seen grows without bound,
the sketch is a fixed 4 x width float32 array. Its width is sized to the *keys* it must tell apart, not to the cache:
a key seen once and evicted still has to keep its count, and on the trace ~24k new keys arrive per half-life while a
1e6-token cache holds 1,953; a width of the cache's size collided so much that the policy fell to LRU's hit ratio.
So width = a power of two >= max(2**20, 8 x ids), at most 2**22 (16-64 MiB, calloc'd: untouched pages cost nothing).

Decay without touching every cell: a cell holds sum(2**(lam * (t_i - t0))) over its accesses; the decayed count at
time t is that times 2**(-lam * (t - t0)), so comparing two cells at one instant needs no decay at all, and log2 of
a cell is a valid priority. When the exponent nears float32's range the whole array is rescaled (every 64
half-lives) and the caller re-keys its heap (`rebased` tells it by how much).
"""

from __future__ import annotations

import math

import numpy as np

from kvproc.native import NATIVE

DEPTH = 4
_MULTIPLIERS = np.array([0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xD6E8FEB86659FD93],
                        dtype=np.uint64)[:, None]
_REBASE_AT = 64.0  # log2 units above t0 before a rescale (float32 holds 2**127)


class DecayedSketch:
    def __init__(self, min_width: int, half_life: float) -> None:
        bits = max(20, min(22, math.ceil(math.log2(max(8 * min_width, 2)))))
        self.shift = np.uint64(64 - bits)
        self.cells = np.zeros((DEPTH, 1 << bits), dtype=np.float32)
        self.rows = np.arange(DEPTH)[:, None]
        self.lam = 0.0 if math.isinf(half_life) else 1.0 / half_life
        self.t0 = 0.0
        self.started = False

    def _idx(self, fps: np.ndarray) -> np.ndarray:
        return (fps[None, :] * _MULTIPLIERS) >> self.shift  # uint64 multiply wraps: multiply-shift hashing

    def add(self, fps: np.ndarray, now: float) -> tuple[np.ndarray, float]:
        """One access of each fingerprint at `now`; returns (log2 of each one's decayed count after it, rebase):
        `rebase` > 0 means every earlier log2 priority must be lowered by that much."""
        rebase = 0.0
        if not self.started:
            self.t0, self.started = now, True
        exp = self.lam * (now - self.t0)
        if exp > _REBASE_AT:
            self.cells *= np.float32(2.0 ** -exp)
            self.t0, rebase, exp = now, exp, 0.0
        if NATIVE is not None:  # the same two passes in C (`_sketch.c`): add.at alone was ~0.6 us a page
            est = np.frombuffer(NATIVE.sketch_add(self.cells, np.ascontiguousarray(fps, dtype=np.uint64),
                                                  int(self.shift), float(np.float32(2.0 ** exp))), dtype=np.float32)
        else:
            idx = self._idx(fps).astype(np.int64)
            np.add.at(self.cells, (np.broadcast_to(self.rows, idx.shape), idx), np.float32(2.0 ** exp))
            est = self.cells[self.rows, idx].min(axis=0)
        return np.log2(est.astype(np.float64)), rebase
