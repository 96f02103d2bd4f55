"""Each rank's device-pool KV events (issue 21): a publisher per rank in the store's process, fed by the pool's prefix
index (`core.paged.IndexListener` -> `tiers.device_index_events.DeviceIndexEvents`). `ClusterStore.start(device_kv_events=True)` starts
them at `attach_model` and names them in the manifest; an in-process store (`build_local_store`) gets them from
`DevicePublishers.start(store, some_dir)`."""

from __future__ import annotations

from kvproc.runtime.event_interval import DEFAULT_INTERVAL_S, interval_ms
from kvproc.store.kv_store import KvStore
from kvproc.tiers.device_index_events import DeviceIndexEvents
from kvproc.tiers.kv_events import KvEventPublisher

KIND = "device"


class DevicePublishers:
    def __init__(self, store: KvStore, publishers: list[KvEventPublisher]) -> None:
        self.store = store
        self.publishers = publishers

    @classmethod
    def start(cls, store: KvStore, runtime_dir: str, batch_interval_s: float = DEFAULT_INTERVAL_S) -> DevicePublishers:
        """One publisher per rank, bound at `kv_events.endpoints(runtime_dir, rank, "device")`, batching over
        `batch_interval_s`; each rank's stream starts with `AllBlocksCleared` and the keys its index holds already."""
        pubs: list[KvEventPublisher] = []
        try:
            for pool in store.pools:
                pub = KvEventPublisher(runtime_dir, pool.rank, kind=KIND, batch_interval_s=batch_interval_s)
                pubs.append(pub)
                DeviceIndexEvents(pub, pool.page_tokens).attach(pool)
        except BaseException:
            cls(store, pubs).close()
            raise
        return cls(store, pubs)

    def published(self) -> dict[str, str]:
        """The endpoints by name, for the manifest (`Manifest.published`)."""
        out: dict[str, str] = {}
        for r, pub in enumerate(self.publishers):
            out[f"kv_events_{KIND}_{r}"] = pub.pub_endpoint
            out[f"kv_events_{KIND}_replay_{r}"] = pub.replay_endpoint
        if self.publishers:  # one setting for all ranks
            out[f"kv_events_{KIND}_interval_ms"] = interval_ms(self.publishers[0].batch_interval_s)
        return out

    def counters(self) -> dict[str, int]:
        """`rank<r>.kv_events.*` (batches, events, queued, replays, seq, failed, dropped), for `kvproc console
        status` and `/metrics`."""
        return {f"rank{r}.{k}": v for r, pub in enumerate(self.publishers) for k, v in pub.stats().items()}

    def close(self) -> None:
        """Stop listening, then publishing (what was queued still goes out first)."""
        for pool in self.store.pools[: len(self.publishers)]:
            DeviceIndexEvents.detach(pool)
        for pub in self.publishers:
            pub.close()
