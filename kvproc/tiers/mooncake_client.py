"""The Mooncake Store client as the host tier uses it: its URL, its connection, and a breaker for an unreachable store.

URL: `mooncake://MASTER_HOST:PORT?metadata=http://HOST:PORT/metadata[&protocol=tcp][&local=HOST][&ns=NAME]
[&timeout=S][&lease_ttl=S]` -- `metadata` is the transfer engine's metadata server (the master's embedded one in the usual setup),
`local` the address this process's transfer engine binds and advertises (default: the master's host when that is a
loopback address, else this machine's hostname), `ns` a namespace prefixed to every key (a fleet's or a tenant's scope;
the model's fingerprint is always part of the key too), `timeout` each remote operation's deadline in seconds,
`lease_ttl` the master's `--default_kv_lease_ttl` in seconds (a key read or checked within it cannot be removed
without force: a revoked hand-off's removal is retried after it).

The library (`pip install 'kvproc[remote]'`, plus the system's libibverbs) is imported only when a tier is configured
with a URL: without one, nothing here runs.

Every call goes through an `OpRunner` (a deadline and one terminal outcome each) and reports to the `Breaker`: a call
that fails as a transport/RPC failure or times out opens it for a backoff (doubling up to `MAX_BACKOFF_S`), during
which the tier does not ask Mooncake at all (resolves degrade to the host tier at once, write-behind is shed); the
first call after the backoff tries again (the client reconnects to a restarted master on its own).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

import structlog

log = structlog.get_logger("kvproc.mooncake")

MIN_BACKOFF_S = 0.25
MAX_BACKOFF_S = 5.0
# Per-key codes (Mooncake's ErrorCode): a transport or RPC failure says the store is unreachable (the breaker opens);
# other negative codes are the store refusing one key (no space, object busy, ...), counted per key.
TRANSFER_FAIL, RPC_FAIL = -800, -900
UNREACHABLE = frozenset({TRANSFER_FAIL, RPC_FAIL})
# `batch_remove`'s per-key codes besides 0 (measured with 0.3.13): the key is gone already, or it is leased (read or
# checked for existence within the master's lease TTL: removable without force only once that has passed).
OBJECT_NOT_FOUND, OBJECT_HAS_LEASE = -704, -706


@dataclass(frozen=True)
class RemoteSpec:
    master: str  # host:port of mooncake_master's RPC
    metadata: str
    protocol: str = "tcp"
    local_host: str = ""
    namespace: str = ""
    timeout_s: float = 2.0
    lease_ttl_s: float = 10.0  # the master's --default_kv_lease_ttl

    @classmethod
    def parse(cls, url: str) -> RemoteSpec:
        u = urlsplit(url)
        if u.scheme != "mooncake" or not u.hostname or not u.port:
            raise ValueError(f"remote must be mooncake://HOST:PORT?metadata=..., got {url!r}")
        q = {k: v[-1] for k, v in parse_qs(u.query).items()}
        unknown = set(q) - {"metadata", "protocol", "local", "ns", "timeout", "lease_ttl"}
        if unknown:
            raise ValueError(f"unknown remote option(s) {sorted(unknown)} in {url!r}")
        if "metadata" not in q:
            raise ValueError(f"remote {url!r} needs ?metadata=http://HOST:PORT/metadata (or P2PHANDSHAKE)")
        local = q.get("local", "")
        if not local:
            try:
                local = u.hostname if ipaddress.ip_address(u.hostname).is_loopback else socket.gethostname()
            except ValueError:  # a host name, not an address
                local = "127.0.0.1" if u.hostname == "localhost" else socket.gethostname()
        timeout = float(q.get("timeout", 2.0))
        lease_ttl = float(q.get("lease_ttl", 10.0))
        if timeout <= 0 or lease_ttl <= 0:
            raise ValueError(f"remote timeout and lease_ttl must be positive, got {timeout}, {lease_ttl}")
        return cls(f"{u.hostname}:{u.port}", q["metadata"], q.get("protocol", "tcp"), local, q.get("ns", ""),
                   timeout, lease_ttl)


class Breaker:
    """Closed (calls go out) or open until `until` (calls are skipped, counted by the caller)."""

    def __init__(self) -> None:
        self.until = 0.0
        self.backoff = MIN_BACKOFF_S
        self.opened = 0
        self._lock = threading.Lock()

    @property
    def closed(self) -> bool:
        return time.monotonic() >= self.until

    def failure(self, why: str) -> None:
        with self._lock:
            if time.monotonic() < self.until:
                return  # already open: one failure per outage window
            self.until = time.monotonic() + self.backoff
            log.warning("mooncake_unreachable", why=why, retry_in_s=round(self.backoff, 2))
            self.backoff = min(self.backoff * 2, MAX_BACKOFF_S)
            self.opened += 1

    def success(self) -> None:
        with self._lock:
            if self.backoff > MIN_BACKOFF_S:
                log.info("mooncake_reachable")
            self.backoff = MIN_BACKOFF_S


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _reachable(hostport: str, timeout: float = 0.5) -> None:
    host, _, port = hostport.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        raise ConnectionError(f"mooncake: {hostport} unreachable: {e}") from None


class MooncakeClient:
    """One `MooncakeDistributedStore`, set up lazily (its setup may block while the master is down) and the host
    segment registered with it once. Methods block: call them through an `OpRunner`."""

    def __init__(self, spec: RemoteSpec, buffer_addr: int, buffer_bytes: int) -> None:
        self.spec = spec
        self.buffer_addr, self.buffer_bytes = buffer_addr, buffer_bytes
        self._store: Any = None
        self._lock = threading.Lock()

    def _ready(self) -> Any:
        with self._lock:
            if self._store is not None:
                return self._store
            # `setup` holds the GIL while it retries an unreachable master (seconds: the host tier's heartbeats
            # would go unanswered), unlike the transfer calls. So it is only called once the master and the metadata
            # server accept a connection; a restarted master is then rejoined by the client on its own.
            _reachable(self.spec.master)
            meta = urlsplit(self.spec.metadata)
            if meta.scheme in ("http", "https") and meta.hostname:
                _reachable(f"{meta.hostname}:{meta.port or 80}")
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", self.spec.local_host)
            from mooncake.store import MooncakeDistributedStore  # optional extra: imported only when configured

            store = MooncakeDistributedStore()
            local = f"{self.spec.local_host}:{_free_port(self.spec.local_host)}"
            # This process contributes no storage (global segment 0) and no staging buffer: every transfer goes
            # from/to the registered host segment (zero-copy batch forms).
            rc = store.setup(local, self.spec.metadata, 0, 0, self.spec.protocol, "", self.spec.master)
            if rc != 0:
                store.close()
                raise ConnectionError(f"mooncake setup failed ({rc}) for master {self.spec.master}")
            rc = store.register_buffer(self.buffer_addr, self.buffer_bytes)
            if rc != 0:
                store.close()
                raise ConnectionError(f"mooncake register_buffer failed ({rc})")
            self._store = store
            log.info("mooncake_connected", master=self.spec.master, local=local, registered=self.buffer_bytes)
            return store

    @property
    def connected(self) -> bool:
        return self._store is not None

    def exists(self, keys: list[str]) -> list[int]:
        return list(self._ready().batch_is_exist(keys))

    def put_from(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]], *,
                 soft_pin_s: float = 0.0) -> list[int]:
        """`soft_pin_s` > 0: the new objects are soft-pinned that long (Mooncake evicts them only when nothing
        unpinned is left to evict, and not at all with the master's `--allow_evict_soft_pinned_objects=false`)."""
        store = self._ready()
        if soft_pin_s <= 0:
            return list(store.batch_put_from_multi_buffers(keys, ptrs, sizes))
        from mooncake.store import ReplicateConfig, SoftPinAction

        config = ReplicateConfig()
        config.soft_pin_action = SoftPinAction.ENABLE
        config.soft_pin_ttl_ms = int(soft_pin_s * 1000)
        return list(store.batch_put_from_multi_buffers(keys, ptrs, sizes, config))

    def remove(self, keys: list[str]) -> list[int]:
        """Never forced: a forced remove would free an object another node may be reading into its host tier right
        now (its read lease is what protects that read)."""
        return list(self._ready().batch_remove(keys, False))

    def get_into(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        return list(self._ready().batch_get_into_multi_buffers(keys, ptrs, sizes))

    def close(self) -> None:
        with self._lock:
            store, self._store = self._store, None
        if store is not None:
            try:
                store.unregister_buffer(self.buffer_addr)
            finally:
                store.close()
