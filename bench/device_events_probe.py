"""Where device-pool KV events cost a blocking host-hit resolve: three arms on one cluster, interleaved in rounds.

    PYTHONPATH=. .venv/bin/python bench/device_events_probe.py [--n 40] [--rounds 10] [--subscribe]

One `ClusterStore.start(device_kv_events=True)` and `IpcBench` (the device pool churned before every resolve, so each
one publishes a removal and a store); per round, each arm times `--n` resolves of 16-page prompts, the arms' order
rotating:
- `off`: rank 0's pool has no listener (what `device_kv_events=False` runs);
- `listener`: the listener builds its events, and the publisher's `publish` is a bare list append (no lock, no
  thread): the cost of the hot path's own work;
- `publisher`: the real `KvEventPublisher` (its thread encodes and sends);
- `no_tokens`: the same, with the events' token ids left out (`BlockStored.token_ids` empty): what carrying them
  costs.
`--subscribe`: a subscriber process reads every batch, as a router would. Prints each arm's median and mean resolve
(us) and the publisher's batch count. A probe, not the headline (that is `kvproc bench ipc --observe-ab N
--device-events`): one process, so it separates the parts.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from typing import Any

from kvproc.bench.ipcbench import ARENA_BLOCK, CONCURRENCY, IpcBench, IpcBenchModel
from kvproc.store.cluster import ClusterStore
from kvproc.store.types import StoreConfig
from kvproc.tiers.kv_events import endpoints

SUBSCRIBER = """
import sys, zmq
s = zmq.Context.instance().socket(zmq.SUB)
s.setsockopt(zmq.SUBSCRIBE, b"")
s.connect(sys.argv[1])
print("ready", flush=True)
while True:
    if s.poll(500):
        s.recv_multipart()
"""


def main(n: int, rounds: int, subscribe: bool, blocks: int = 16) -> None:
    host_bytes = (rounds * 4 * n + 200) * blocks * 2 * ARENA_BLOCK + (4 << 20)
    cs = ClusterStore.start(host_bytes, device_kv_events=True)
    sub: subprocess.Popen[str] | None = None
    try:
        model = IpcBenchModel(cs.allocator, 2048)
        store = cs.attach_model(model, live_slots=CONCURRENCY, config=StoreConfig(cacheable_pin_fraction=1.0))
        assert cs.device_events is not None
        pub = cs.device_events.publishers[0]
        if subscribe:
            sub = subprocess.Popen([sys.executable, "-c", SUBSCRIBER, endpoints(cs.cluster.runtime_dir, 0, "device")[0]],
                                   stdout=subprocess.PIPE, text=True)
            assert sub.stdout is not None and sub.stdout.readline().strip() == "ready"
            time.sleep(0.3)  # the subscription joins
        b = IpcBench(cs, store, model)
        pool = store.pools[0]
        listener, real_publish = pool.paged.listener, pub.publish
        sink: list[Any] = []
        times: dict[str, list[float]] = {"off": [], "listener": [], "publisher": [], "no_tokens": []}
        arms = list(times)
        stored = listener.stored  # type: ignore[union-attr]
        try:
            for r in range(rounds):
                for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
                    prompts = [b.prompt(blocks) for _ in range(n)]
                    for p in prompts:
                        b.seal(p)
                    assert pub.flush()
                    with pool.lock:
                        pool.paged.listener = None if arm == "off" else listener
                    pub.publish = sink.extend if arm == "listener" else real_publish  # type: ignore[method-assign, assignment]
                    if arm == "no_tokens":
                        listener.stored = lambda h, ps, tokens=None: stored(h, ps, None)  # type: ignore[method-assign, union-attr]
                    times[arm] += [b.resolve(p, blocks) for p in prompts]
                    pub.publish = real_publish  # type: ignore[method-assign]
                    listener.__dict__.pop("stored", None)
                    with pool.lock:
                        pool.paged.listener = listener
                    assert pub.flush()
        finally:
            b.close()
        print(f"# {rounds} rounds x {n} blocking host-hit resolves of {blocks} pages per arm, one cluster, arms "
              f"interleaved; subscriber: {'yes' if subscribe else 'no'}")
        for arm, t in times.items():
            print(f"{arm:9s} median {statistics.median(t) * 1e6:6.0f} us  mean {statistics.fmean(t) * 1e6:6.0f} us")
        print(f"publisher: {pub.batches} batches, {pub.events} events")
    finally:
        if sub is not None:
            sub.kill()
            sub.wait()
        cs.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="bench/device_events_probe.py")
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--subscribe", action="store_true")
    a = ap.parse_args()
    main(a.n, a.rounds, a.subscribe)
