"""The device pool's KV-event batch encoder: the compiled form (`kvproc/native/_kv_events.c`) against the pure-Python
one (`DeviceBatchEncoder.python`, msgspec), in the same run, on the records a busy pool queues.

A batch here is what `kvproc bench ipc`'s resolves make: per resolve one `BlockStored` of 16 pages of 16 tokens
(its 16 keys, the parent, the prompt's tokens) and 16 one-key removals (the churn). The prompts cycle through
`--prompts` distinct ones so that their tokens and keys are as cold as in place (the publisher's thread reads them
up to an interval after the resolve made them). Three forms of the tokens: the prompt as its hash packed it (what a
restore registers since the eighth session), an int64 array (a computed page's, from its request), and the engine's
list of Python ints (what a restore registered before). The keys are packed into one bytes object per record, as
the pool's listener queues them since the ninth session (`--list-keys`: as lists of 16-byte keys, the form the numbers
recorded before it were taken with). Then the GIL: how much of an engine's busy thread's time is
lost while the publisher's thread writes a steady-state batch, with the GIL held throughout the write and let go
while writing (as shipped). Last, the publisher's take of a batch's records from its queue.

    .venv/bin/python bench/device_event_encode.py [--resolves 15] [--batches 400] [--list-keys]
"""

from __future__ import annotations

import argparse
import collections
import itertools
import statistics
import threading
import time

import numpy as np

from kvproc.core.hashing import PAD_TOKEN_ID
from kvproc.native import NATIVE
from kvproc.tiers.device_index_events import REMOVED, STORED, DeviceBatchEncoder

PAGES, PAGE = 16, 16


def stall_arm(enc: DeviceBatchEncoder, batch: list, release_gil: bool, seconds: float) -> list[float]:
    """The main thread runs Python without pause (an engine's scheduler loop), timing each small chunk of it, while
    another thread encodes `batch` every millisecond: a chunk that took long waited for the GIL."""
    stop = threading.Event()

    def encode() -> None:
        while not stop.is_set():
            NATIVE.kv_device_batch(1.0, batch, enc.block_size, enc.medium, PAD_TOKEN_ID, enc.encode_event,
                                   release_gil)
            time.sleep(0.001)

    t = threading.Thread(target=encode)
    t.start()
    chunks: list[float] = []
    end = time.perf_counter() + seconds
    try:
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            sum(range(200))  # ~1-2 us of bytecode
            chunks.append(time.perf_counter() - t0)
    finally:
        stop.set()
        t.join()
    return chunks


def stalls(enc: DeviceBatchEncoder, tokens: list, keys: list, key_lists: list, churn: list,
           a: argparse.Namespace) -> None:
    """A steady 50 ms batch (`--steady` resolves' events), encoded holding the GIL throughout and letting it go
    while writing (as shipped), in alternating blocks: the main thread's time lost in chunks over 100 us."""
    batch = []
    for i in range(a.steady):
        i %= a.prompts
        batch.append((STORED, keys[i], key_lists[i - 1][-1], tokens[i], 0, PAGES))
        batch += [(REMOVED, churn[(i * PAGES + k) % len(churn)]) for k in range(PAGES)]
    lost: dict[bool, list[float]] = {True: [], False: []}
    worst: dict[bool, float] = {True: 0.0, False: 0.0}
    for block in range(2 * a.stall_blocks):
        release = block % 4 in (0, 3)  # ABBA
        chunks = stall_arm(enc, batch, release, 1.0)
        lost[release].append(sum(c for c in chunks if c > 100e-6))
        worst[release] = max(worst[release], max(chunks))
    print(f"# a batch of {a.steady} resolves' events encoded every 1 ms by a second thread, the main thread running "
          f"Python throughout; its time lost in chunks over 100 us, per second ({a.stall_blocks} blocks of 1 s per "
          f"arm, ABBA)")
    for release in (False, True):
        print(f"{'GIL let go while writing' if release else 'GIL held throughout':26s} lost "
              f"{statistics.median(lost[release]) * 1e3:6.1f} ms/s (median block)  longest stall "
              f"{worst[release] * 1e6:7.0f} us")
    print(f"ratio held / let go: {statistics.median(lost[False]) / statistics.median(lost[True]):.2f}x")


def takes(records: list, reps: int = 200) -> None:
    """The publisher's take of a batch's records from its queue: a loop that pops and sorts each (before) against
    every popleft called from C (`KvEventPublisher._take`, as shipped), same run, median of `reps`."""
    q: collections.deque = collections.deque()

    def loop() -> list:
        events: list = []
        markers: list = []
        for _ in range(len(q)):
            item = q.popleft()
            (markers if isinstance(item, threading.Event) else events).append(item)
        return events

    def from_c() -> list:
        return list(itertools.starmap(q.popleft, itertools.repeat((), len(q))))

    t: dict[str, list[float]] = {"loop": [], "from C": []}
    for i in range(reps):
        for name, f in (("loop", loop), ("from C", from_c)) if i % 2 else (("from C", from_c), ("loop", loop)):
            q.extend(records)
            t0 = time.thread_time()
            f()
            t[name].append(time.thread_time() - t0)
    lo, c = statistics.median(t["loop"]), statistics.median(t["from C"])
    print(f"# the publisher's take of {len(records)} queued records, median of {reps}")
    print(f"loop {lo * 1e6:.1f} us  from C {c * 1e6:.1f} us  ratio {lo / c:.1f}x")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--resolves", type=int, default=15, help="resolves per batch (15: the per-resolve A/B's)")
    ap.add_argument("--batches", type=int, default=400)
    ap.add_argument("--prompts", type=int, default=4000, help="distinct prompts cycled through (cold caches)")
    ap.add_argument("--steady", type=int, default=200,
                    help="resolves per batch in the GIL part (200: ~4,000 resolves/s over a 50 ms interval)")
    ap.add_argument("--list-keys", action="store_true",
                    help="queue each record's keys as a list of 16-byte keys (before the ninth session), not packed")
    ap.add_argument("--stall-blocks", type=int, default=4, help="blocks of 1 s per arm in the GIL part")
    a = ap.parse_args()
    if NATIVE is None:
        raise SystemExit("kvproc.native._native is not built (or KVPROC_PURE_PYTHON=1): nothing to compare")
    rng = np.random.default_rng(0)
    lists = [rng.integers(0, 150_000, PAGES * PAGE + 1).tolist() for _ in range(a.prompts)]
    forms = {"packed (a restore's)": [np.array(t, "<u4").tobytes() for t in lists],
             "int64 array (a computed page's)": [np.array(t, np.int64) for t in lists],
             "list of ints (a restore's, before)": lists}
    key_lists = [[rng.bytes(16) for _ in range(PAGES)] for _ in range(a.prompts)]
    churn_lists = [[rng.bytes(16)] for _ in range(a.prompts * PAGES)]
    # A record's parent stays one key object (the listener's `hashes[first - 1]`); its keys are packed or listed.
    keys: list = key_lists if a.list_keys else [b"".join(k) for k in key_lists]
    churn: list = churn_lists if a.list_keys else [k[0] for k in churn_lists]
    enc = DeviceBatchEncoder(PAGE)
    print(f"# {a.batches} batches of {a.resolves} resolves' events ({a.resolves} BlockStored of {PAGES} pages "
          f"x {PAGE} tokens, {a.resolves * PAGES} one-key removals), {a.prompts} prompts cycled, keys "
          f"{'listed' if a.list_keys else 'packed'}; median us per batch")
    for form, tokens in forms.items():
        times: dict[str, list[float]] = {"python": [], "native": []}
        for b in range(a.batches):
            items = []
            for r in range(a.resolves):
                i = (b * a.resolves + r) % a.prompts
                items.append((STORED, keys[i], key_lists[i - 1][-1], tokens[i], 0, PAGES))
                items += [(REMOVED, churn[(i * PAGES + k) % len(churn)]) for k in range(PAGES)]
            arms = (("python", enc.python), ("native", enc))
            for name, f in arms if b % 2 else arms[::-1]:
                t = time.thread_time()
                f(1.0, items)
                times[name].append(time.thread_time() - t)
        py, nat = statistics.median(times["python"]), statistics.median(times["native"])
        print(f"{form:36s} python {py * 1e6:7.1f}  native {nat * 1e6:7.1f}  ratio {py / nat:5.1f}x")
    stalls(enc, forms["packed (a restore's)"], keys, key_lists, churn, a)
    takes([(REMOVED, churn[k]) for k in range(100 * (PAGES + 1))])  # ~100 resolves' records
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
