"""A small WSGI server for `/metrics`: a fixed pool of threads, a bound on connections waiting for one, and a
timeout on every connection.

prometheus_client's own server starts a thread per connection with no bound: 600 slow connections made 613 threads
in one host tier process (issue 39), each holding a stack until its client went away. Here a connection takes a pool
thread; past `queued` connections waiting for a thread it is closed at once (counted, `refused`), and a connection
that sends nothing for `timeout_s` is closed by its socket timeout. A scraper (Prometheus: one request every few
seconds) never sees the difference.
"""

from __future__ import annotations

import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

WORKERS = 4  # connections served at once
QUEUED = 32  # connections waiting for a worker; more are closed at once
TIMEOUT_S = 5.0  # a connection silent this long (request not sent, response not read) is closed


class _QuietHandler(WSGIRequestHandler):
    timeout = TIMEOUT_S  # socketserver sets it on the connection: a silent client costs a worker this long at most

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        return  # a scrape per few seconds: no access log on stderr


class PooledWSGIServer(WSGIServer):
    """`WSGIServer` whose connections are served by a bounded thread pool (see the module's docstring)."""

    # The kernel's accept queue: with socketserver's 5, a burst of connections waits out SYN retries (seconds each)
    # before this server even sees them to serve or close them.
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type[WSGIRequestHandler], *, workers: int = WORKERS,
                 queued: int = QUEUED) -> None:
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvproc-metrics")
        self._slots = threading.BoundedSemaphore(workers + queued)
        self.refused = 0  # connections closed at once: every worker busy and the queue full
        super().__init__(address, handler)  # may fail (address taken): server_close then shuts the pool

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        self._pool.submit(self._serve, request, client_address)

    def _serve(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except (OSError, socket.timeout):
            pass  # a client that went away or stayed silent: nothing to answer
        except Exception:  # noqa: BLE001 - the server's own report, as socketserver does
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self._slots.release()

    def server_close(self) -> None:
        super().server_close()
        self._pool.shutdown(wait=False)


def serve(app: Callable[..., Any], host: str, port: int, *, timeout_s: float = TIMEOUT_S,
          **kw: Any) -> tuple[PooledWSGIServer, threading.Thread]:
    """Serve `app` on (host, port) from a daemon thread; returns the server (its `server_port`) and that thread.
    `workers` / `queued` (keywords) as `PooledWSGIServer`'s."""
    handler = type("_Handler", (_QuietHandler,), {"timeout": timeout_s})
    server = PooledWSGIServer((host, port), handler, **kw)
    server.set_app(app)
    thread = threading.Thread(target=server.serve_forever, name="kvproc-metrics-http", daemon=True)
    thread.start()
    return server, thread
