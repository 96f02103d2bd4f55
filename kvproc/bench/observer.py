"""What an operator's stack does while a bench runs (`kvproc bench ipc --observe`), as its own process: scrape
Prometheus /metrics every second (or every ARGV[3] s) and read every KV event batch, until stdin closes; prints
"ready" once subscribed and scraped once, then at the end the counts as JSON.

    python -m kvproc.bench.observer HOST:PORT ipc://.../kv-events-0[,ipc://.../kv-events-device-0]

(several event endpoints, comma-separated: one SUB socket connected to each, as a router subscribes to every tier).
An interval of 0 scrapes only when told: each line on stdin is one scrape, answered by a line "scraped" on stdout
(`kvproc/bench/observe_toggle.py` times its scrapes by the bench's own clock).

Imports neither torch nor the store: it must cost what a real scraper and subscriber cost, no more.
"""

from __future__ import annotations

import json
import sys
import threading
import urllib.request

import zmq

from kvproc.tiers.kv_events import TOPIC


def observe(address: str, endpoint: str, every_s: float = 1.0) -> dict[str, int]:
    stop = threading.Event()
    counts = {"metrics_scrapes": 0, "kv_event_batches_read": 0}

    def scrape_once() -> None:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
            r.read()
        counts["metrics_scrapes"] += 1

    def scrape() -> None:
        while not stop.wait(every_s):
            scrape_once()

    def until_stdin_closes() -> None:
        if every_s > 0:
            sys.stdin.read()
        else:  # on demand: a line, a scrape
            for _ in sys.stdin:
                scrape_once()
                print("scraped", flush=True)
        stop.set()

    sub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
    for e in endpoint.split(","):
        sub.connect(e)
    scrape_once()  # the endpoint answers, and meanwhile the subscription has joined: the bench may start timing
    print("ready", flush=True)
    threads = [threading.Thread(target=f, daemon=True)
               for f in ((scrape, until_stdin_closes) if every_s > 0 else (until_stdin_closes,))]
    for t in threads:
        t.start()
    while not stop.is_set():
        if sub.poll(200):
            sub.recv_multipart()
            counts["kv_event_batches_read"] += 1
    threads[0].join(15)
    sub.close(linger=0)
    return counts


if __name__ == "__main__":
    print(json.dumps(observe(sys.argv[1], sys.argv[2], float(sys.argv[3]) if len(sys.argv) > 3 else 1.0)), flush=True)
