"""Every kvproc wire type, in one module.

Each message is one ZeroMQ frame: a msgspec Struct encoded as a msgpack array whose first element is an integer tag.
Sockets carry metadata only (ids, slots, hashes, lease ids); KV bytes travel through shared memory (`segment.py`).

Decoders are typed per socket direction: a server decodes `ClientMsg`, a client decodes `ServerMsg`, and a request
body must be one of `RequestBody`, a reply payload one of `Payload`. Anything else is a decode error that the
receiver answers with a typed `Failed` (where a reply is possible) and a log line; it never kills the process.

Rules (read before editing):
- A tag is never reused, not even after its type is deleted: retire it with a line in the table below.
- New fields go last and have defaults (old peers omit them, new peers ignore nothing they do not know).
- A change that breaks either rule bumps `PROTOCOL_VERSION`; the handshake refuses a mismatch with both versions.

Adding a request (e.g. the next issue's host tier `Query`):
1. pick free tags in the role's range: a request class deriving `Request`, a payload class deriving `Payload`;
2. add them to the `RequestBody` / `Payload` unions at the bottom and to the table here;
3. write a handler on the role: `@handles(Query) def query(self, msg: Query, ctx: CallContext) -> QueryResult`.
   Handlers are checked against these unions when the role is built, so a forgotten step fails at boot.

Tag table (ranges: 1-49 envelope and control, 100-199 runtime requests, 200-299 runtime payloads,
300-399 host-tier requests, 400-499 host-tier payloads, 500-599 copy-worker requests, 600-699 copy-worker payloads):

| tag | type           | direction          | meaning                                                          |
|-----|----------------|--------------------|------------------------------------------------------------------|
| 1   | Hello          | client -> server   | handshake: protocol version, auth token, client name, session id |
| 2   | Welcome        | server -> client   | handshake accepted: version, role, rank, pid, session id         |
| 3   | Refused        | server -> client   | handshake refused: code, message, server version                 |
| 4   | Call           | client -> server   | request envelope: call id, absolute deadline, cancel token, body, session id |
| 5   | Cancel         | client -> server   | cancel every call carrying this token (no reply)                 |
| 6   | Heartbeat      | client -> server   | liveness probe when idle                                         |
| 7   | HeartbeatAck   | server -> client   | answer to Heartbeat, sent by the socket thread                   |
| 8   | Goodbye        | both               | server: it is leaving (fail every pending call with PeerDead); client: this socket closes (forget it) |
| 10  | Ok             | server -> client   | terminal: success with a typed payload                           |
| 11  | Failed         | server -> client   | terminal: error code, remote exception type, message             |
| 12  | Cancelled      | server -> client   | terminal: the call's token was cancelled                         |
| 13  | PeerDead       | (local)            | terminal: the peer is gone (made by the client, may be sent)     |
| 20  | Ready          | child -> launcher  | start-up pipe: the child serves at these endpoints               |
| 21  | StartupFailed  | child -> launcher  | start-up pipe: the child could not start (traceback)             |
| 100 | Ping           | request            | echo a payload (answered by the socket thread: transport probe)  |
| 101 | Stats          | request            | process and role counters                                        |
| 102 | Profile        | request            | sample own stacks for N seconds while serving, write a report    |
| 103 | Shutdown       | request            | orderly stop after replying                                      |
| 110 | Sleep          | request (debug)    | sleep in small steps, observing cancellation and deadline        |
| 111 | Fail           | request (debug)    | raise a HandlerError with this code and message                  |
| 112 | Echo           | request (debug)    | echo a payload through a handler thread (Pong): the pool's probe |
| 200 | Pong           | payload            | answer to Ping                                                   |
| 201 | StatsReport    | payload            | answer to Stats                                                  |
| 202 | ProfileReport  | payload            | answer to Profile: report path and sample count                  |
| 203 | Done           | payload            | empty success                                                    |
| 300 | Configure      | host-tier request  | set the tier's layout (first engine) or join it (same fingerprint) |
| 301 | Query          | host-tier request  | longest committed prefix of these page hashes: Miss/Loading/Hit  |
| 302 | WaitSettled    | host-tier request  | deferred: answered when a pending save settles (or at deadline)  |
| 303 | WaitKey        | host-tier request  | deferred: answered when an entry for the key commits (or deadline)|
| 304 | ReleaseLease   | host-tier request  | release a Hit's lease (optionally consume a producer's hand-off) |
| 305 | ReserveSave    | host-tier request  | reserve slots for a save (optional retention hint): SaveTicket or Shed |
| 306 | CommitSave     | host-tier request  | the copy landed: make the save's entries visible                 |
| 307 | AbortSave      | host-tier request  | the copy failed: free the save's slots                           |
| 308 | RevokeHandoff  | host-tier request  | "nobody will read this": drop a producer's hand-off pins         |
| 309 | TierStats      | host-tier request  | the index's counters                                             |
| 400 | Configured     | host-tier payload  | the host segment's name and the layout in force                  |
| 401 | TierMiss       | host-tier payload  | Query: nothing usable                                            |
| 402 | TierLoading    | host-tier payload  | Query: a save in flight will fill the next page (wait on save_id)|
| 403 | TierHit        | host-tier payload  | Query: pages, lease id, page slots, bounded slots                |
| 404 | TierSaveTicket | host-tier payload  | ReserveSave: slots to copy into (None: already present)          |
| 405 | TierShed       | host-tier payload  | ReserveSave: refused (tier full), with the reason                |
| 406 | Waited         | host-tier payload  | WaitSettled/WaitKey: True when it happened, False at deadline    |
| 407 | TierCounters   | host-tier payload  | TierStats: counters                                              |
| 500 | AttachArenas   | copy-worker req.   | map the scheduler's arena segments and the host segment          |
| 501 | Save           | copy-worker req.   | device -> host copy order (SaveOrder)                            |
| 502 | Load           | copy-worker req.   | host -> device copy order (LoadOrder)                            |
| 503 | DeviceCopy     | copy-worker req.   | device -> device bounded slot copies                             |
| 504 | EngineMove     | copy-worker req.   | engine's own memory (pid, addresses) <-> arenas, by CMA          |
| 600 | Copied         | copy-worker payload| bytes copied by an order                                         |
| 601 | Attached       | copy-worker payload| AttachArenas done: arenas mapped, host bytes mapped              |

Sessions: a connection's `Hello` carries a random nonzero session id (the client's choice, so calls can be pipelined
behind the Hello; 0 asks the server to pick one, returned in `Welcome`); every later message on that connection
(`Call`, `Cancel`, `Heartbeat`, `Goodbye`) carries it, and the server serves only what carries the session its routing
id was admitted with. A ZeroMQ routing id can be reused by a socket that reconnects with ZMQ_ROUTING_ID set; the
session cannot (version 2; version 1 trusted the routing id alone).

Deadlines are absolute `CLOCK_MONOTONIC` nanoseconds (`time.monotonic_ns()`), which Linux shares between all
processes of one host (and across containers without a time namespace): comparable on one node, immune to wall-clock
steps. kvproc's tcp endpoints serve engines on the same node, so this holds there too.
"""

from __future__ import annotations

from typing import Any, NoReturn, Union, get_args

import msgspec

from kvproc.ipc.errors import CallCancelled, PeerDeadError, RemoteError
from kvproc.ipc.orders import LoadOrder, SaveOrder, SlotCopy

PROTOCOL_VERSION = 2


class Wire(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Base of every wire type: array encoding (no field names on the wire), tagged by subclasses."""


class Request(Wire):
    """Base of request bodies (the `body` of a `Call`)."""


class Payload(Wire):
    """Base of `Ok` payloads."""


# ---- envelope and control --------------------------------------------------------------------------------------


class Hello(Wire, tag=1):
    version: int
    token: str
    client: str = ""  # the client's identity (the server bounds its peers per identity), e.g. "engine@<pid>"
    session: int = 0  # this connection's session id (nonzero; 0: the server picks one, see the module docstring)


class Welcome(Wire, tag=2):
    version: int
    role: str
    rank: int
    pid: int
    session: int = 0  # the session id the connection was admitted with


class Refused(Wire, tag=3):
    code: str
    message: str
    server_version: int = PROTOCOL_VERSION


class Cancel(Wire, tag=5):
    token: int
    session: int = 0


class Heartbeat(Wire, tag=6):
    seq: int = 0
    session: int = 0


class HeartbeatAck(Wire, tag=7):
    seq: int = 0


class Goodbye(Wire, tag=8):
    reason: str = ""
    session: int = 0  # client -> server: the closing connection's session id


# ---- terminal replies: every Call ends in exactly one of these ---------------------------------------------------


class Failed(Wire, tag=11):
    call_id: int
    code: str
    exc_type: str
    message: str

    def unwrap(self) -> NoReturn:
        raise RemoteError(self.code, self.exc_type, self.message)


class Cancelled(Wire, tag=12):
    call_id: int
    token: int

    def unwrap(self) -> NoReturn:
        raise CallCancelled(self.token)


class PeerDead(Wire, tag=13):
    call_id: int
    reason: str

    def unwrap(self) -> NoReturn:
        raise PeerDeadError(self.reason)


# ---- start-up pipe (child -> launcher, not ZeroMQ) ---------------------------------------------------------------


class Ready(Wire, tag=20):
    pid: int
    endpoints: list[str]
    segments: list[str] = []
    published: dict[str, str] = {}  # other endpoints the child serves, by name (e.g. KV events): into the manifest


class StartupFailed(Wire, tag=21):
    error: str


# ---- runtime requests and payloads -------------------------------------------------------------------------------


class Ping(Request, tag=100):
    data: bytes = b""


class Stats(Request, tag=101):
    pass


class Profile(Request, tag=102):
    seconds: float = 5.0
    interval_ms: float = 5.0


class Shutdown(Request, tag=103):
    reason: str = ""


class Sleep(Request, tag=110):
    seconds: float
    step_s: float = 0.01


class Fail(Request, tag=111):
    message: str
    code: str = "debug"


class Echo(Request, tag=112):
    data: bytes = b""


class Pong(Payload, tag=200):
    data: bytes = b""
    pid: int = 0


class StatsReport(Payload, tag=201):
    role: str
    rank: int
    pid: int
    uptime_s: float
    rss_bytes: int
    threads: int
    in_flight: int  # calls accepted and not yet replied to
    queued: int  # calls waiting for a handler thread
    outbox: int  # replies waiting for the socket thread
    msgs_in: int
    msgs_out: int
    errors: int  # malformed frames, refused handshakes, handler exceptions
    counters: dict[str, int] = {}
    segments: list[str] = []


class ProfileReport(Payload, tag=202):
    path: str
    samples: int


class Done(Payload, tag=203):
    pass


# ---- host tier (kvproc/tiers/host.py) ---------------------------------------------------------------------------
# Nested, untagged structs: a host layout as plain metadata (kvproc.tiers.layout.HostLayout converts to and from it).


class RegionSpec(Wire):
    arena: str
    group: str
    offset: int
    unit_bytes: int
    slots: int


class HostLayoutSpec(Wire):
    regions: list[RegionSpec]
    page_slots: int
    bounded_slots: dict[str, int]
    total_bytes: int
    slot_table_offset: int = -1  # the page-slot table (kvproc.tiers.slot_table); -1: none


class Configure(Request, tag=300):
    fingerprint: str  # human-readable capability string (model, arenas, page size); a mismatch is refused
    layout: HostLayoutSpec
    required_bounded: list[str] = []  # bounded groups a checkpoint must hold to be a hit
    # The store's eviction policy (`StoreConfig.eviction`) for the index this Configure creates; "" lets the tier
    # choose. A tier started with its own (`kvproc up --eviction`) keeps that one.
    eviction: str = ""


class Query(Request, tag=301):
    req_id: str
    hashes: list[bytes]
    # The prompt's page before `hashes[0]` (a query starts after the asking store's device hit), sent only to a tier
    # that publishes KV events (`RemoteTier.wants_parent_key`): the parent of the pages it pulls from a Mooncake Store
    # for this query. None at the prompt's first page, or when off (one msgpack nil on the wire, as ReserveSave's).
    parent: bytes | None = None
    # The store's id for this query's lease (random per store, then counting; 0: none). A store whose query failed
    # (its client declared the tier dead, the deadline passed) releases the lease it may have made by this id:
    # `ReleaseLease.claim` (kvproc/tiers/reservations.py).
    claim: int = 0


class WaitSettled(Request, tag=302):
    save_id: int


class WaitKey(Request, tag=303):
    key: bytes


class ReleaseLease(Request, tag=304):
    lease_id: int  # 0 with `claim`: the lease, if any, of the query that carried that claim
    consume_handoff: str = ""  # "" = none
    claim: int = 0  # `Query.claim` of a query its store gave up on: its lease released, or the query refused later


class SaveEvents(Wire):
    """`ReserveSave.events` for a tier that publishes KV events: what the save's `BlockStored` need beyond its keys."""

    # The prompt's page before the save's first (None: the save starts at the prompt's first page, or the tier's
    # events do not want it): the parent of the save's first run of new pages when that run starts at the save's
    # first key (the tier sees no chain before it).
    parent_key: bytes | None = None
    # The pages' token ids (int64, native order, page i's at [i * page_tokens, (i + 1) * page_tokens)), when the
    # tier's events carry them (`Configured.token_ids`); else None.
    token_ids: bytes | None = None


class ReserveSave(Request, tag=305):
    req_id: str
    keys: list[bytes]
    bounded_groups: list[str]
    save_class: str  # SaveClass value: "cacheable" | "handoff"
    # What the tier's KV events need that the keys do not say, in ONE trailing slot: msgspec writes an array-like
    # struct's defaults too (a None is one msgpack nil on every ReserveSave), so a field per item would cost every
    # save a byte each. Sent only to a tier that publishes KV events (`Configured.kv_events`); None otherwise.
    events: SaveEvents | None = None
    # The store's id for this reservation (random per store, then counting; 0: none). A store whose call failed
    # (a tier stalled past its heartbeats serves the request later, and the ticket goes nowhere) aborts the save by
    # it: `AbortSave.reservation` (kvproc/tiers/reservations.py).
    reservation: int = 0
    # A retention hint (`KvStore.seal/retire(retain_s=...)`): the request's conversation comes back within about this
    # many seconds, so the save's pages rank in the tier's eviction policy as if used that much later (bounded by the
    # tier's `max_retain_s`; a priority, never a pin). None: none (one msgpack nil: msgspec writes an array-like
    # struct's trailing defaults too, and a float would be 9 bytes on every save).
    retain_s: float | None = None


class CommitSave(Request, tag=306):
    save_id: int


class AbortSave(Request, tag=307):
    save_id: int
    # The store proved the copy worker that had this save's order dead (its process is gone): a claim it left on the
    # save's fence cannot be a write in progress, so the tier takes it back instead of quarantining the slots.
    writer_dead: bool = False
    # Not 0: abort the save this store reserved under that id, whose ticket it never got (`save_id` is 0 then); one
    # not seen yet is remembered, and refused if it still comes (kvproc/tiers/reservations.py).
    reservation: int = 0


class RevokeHandoff(Request, tag=308):
    req_id: str
    # The consumer has the hand-off's KV (a device hit: no load consumed it): its pins go, the pages stay as cache
    # everywhere. Without it: nobody will read the hand-off (the tier below also drops what the hand-off put there).
    consumed: bool = False


class TierStats(Request, tag=309):
    pass


class Configured(Payload, tag=400):
    segment: str
    layout: HostLayoutSpec
    fingerprint: str = ""
    token_ids: bool = False  # the tier's KV events carry token ids: send them with each `ReserveSave`
    kv_events: bool = False  # the tier publishes KV events: send each `ReserveSave` its `SaveEvents` (parent page)
    # Random per tier process: a store reconnecting after its client died tells a stalled tier (same incarnation:
    # its leases, saves and slots stand) from a replaced one (a `kvproc up` restarted on the runtime dir: nothing of
    # the old one is trusted, the store re-attaches; `ClusterStore._reconnect_external`). A pid cannot tell them
    # apart: a restarted container reuses its pids.
    incarnation: int = 0
    eviction: str = ""  # the policy the tier's index evicts by (its own, or the first Configure's)


class TierMiss(Payload, tag=401):
    pass


class TierLoading(Payload, tag=402):
    ready_pages: int
    save_id: int


class TierHit(Payload, tag=403):
    pages: int
    lease_id: int
    page_slots: list[int]
    bounded_slots: dict[str, int]
    page_gens: list[int] = []  # each page slot's generation (a copy out of them checks it after: `TierSlots`)


class TierSaveTicket(Payload, tag=404):
    save_id: int
    req_id: str
    save_class: str
    keys: list[bytes]
    page_slots: list[Union[int, None]]  # None: already present (dedup), nothing to copy
    bounded_slots: dict[str, Union[int, None]]
    expires: float  # the tier's monotonic clock; informational
    fence: int = -1  # the save's fence word (`kvproc/tiers/save_fence.py`); -1: none
    fence_token: int = 0


class TierShed(Payload, tag=405):
    reason: str


class Waited(Payload, tag=406):
    ok: bool


class TierCounters(Payload, tag=407):
    counters: dict[str, int]


# ---- copy worker (kvproc/workers/worker.py) ---------------------------------------------------------------------


class CudaIpcRef(Wire):
    """A GPU arena's memory as torch's CUDA IPC handle (`kvproc/ipc/cuda_ipc.py`: `UntypedStorage._share_cuda_`'s
    fields, passed back unchanged to `_new_shared_cuda`). In an `ArenaRef` it replaces the segment; the ref's
    `offset` is then the arena's first byte in the shared storage."""

    device: int  # the CUDA device index; the worker opening it must be bound to the same one
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


class ArenaRef(Wire):
    """One device arena: where it lives (segment + byte offset, or a CUDA IPC handle + offset) and its KvArena
    geometry."""

    group: str
    kind: str  # GroupKind value: "paged" | "bounded"
    name: str
    segment: str
    offset: int
    num_blocks: int
    bytes_per_block: int
    block_stride: int
    stored_bytes_per_block: int = 0  # 0 = same as bytes_per_block
    stored_layout: str = ""  # "" = stored as executed (no repack); else the declared stored layout's name
    cuda: Union[CudaIpcRef, None] = None  # a GPU arena: opened by CUDA IPC on the worker's device ("segment" is "")


class AttachArenas(Request, tag=500):
    arenas: list[ArenaRef]
    host_segment: str  # "" = no host tier (device copies only)
    host_layout: Union[HostLayoutSpec, None] = None
    repack: str = ""  # "module:function" of a (group, direction, src, dst, arena) callable; "" = none
    page_tokens: int = 1
    # The store's load-fence words (`kvproc/tiers/load_fence.py`): segment, byte offset, int64 words. "" = none.
    load_fences: str = ""
    load_fence_offset: int = 0
    load_fence_words: int = 0
    # Which mover the worker's executor uses (`kvproc.workers.movers.mover_for(kind=)`): "" = the arenas' device's
    # default (memmove on CPU, cuda on a GPU); "torch" = the torch rows mover on CPU arenas (the GPU path's logic);
    # "cuda_mapped" = GPU arenas moved by the mapped CUDA mover (`kvproc/workers/mapped_mover.py`, never run).
    mover: str = ""
    # Which attachment of the host tier this is (0, then +1 each time the store re-attaches to a replaced tier):
    # a `LoadOrder` names the one its slots come from, and the worker refuses one from another (its slots index
    # another tier's segment).
    host_epoch: int = 0


class Save(Request, tag=501):
    order: SaveOrder


class Load(Request, tag=502):
    order: LoadOrder


class DeviceCopy(Request, tag=503):
    copies: list[SlotCopy]
    # Its load-fence word and token (`kvproc/tiers/load_fence.py`): a device copy the store gave up on (and whose
    # slots it fenced as failed) writes nothing when a stalled worker runs it late. -1: no fence.
    fence: int = -1
    fence_token: int = 0
    # The engine's step event (a CUDA IPC handle), as `SaveOrder.after_event`: a seal-by-copy reads live state the
    # engine's step wrote, a restore copy writes live slots its earlier steps used; the worker's stream waits on it.
    after_event: bytes | None = None


class EngineMove(Request, tag=504):
    """Blocks between an engine process's private memory and this worker's arenas, by cross-memory attach
    (`kvproc.workers.cma`): engine block `engine_ids[i]` of layer `l` is at `engine_bases[l] + id * engine_stride`
    in process `pid`; arena block `arena_ids[i]` of `arenas[l]`. `to_engine`: arenas -> engine (a load)."""

    pid: int
    to_engine: bool
    arenas: list[str]
    engine_bases: list[int]
    engine_stride: int
    block_bytes: int
    engine_ids: list[int]
    arena_ids: list[int]


class Copied(Payload, tag=600):
    nbytes: int
    ns: int = 0  # the worker's own time executing the order (the bytes' cost where they moved; benchmarks)


class Attached(Payload, tag=601):
    arenas: int
    host_bytes: int


# ---- the unions (add new request and payload types here) ---------------------------------------------------------

RequestBody = Union[
    Ping, Stats, Profile, Shutdown, Sleep, Fail, Echo,
    Configure, Query, WaitSettled, WaitKey, ReleaseLease, ReserveSave, CommitSave, AbortSave, RevokeHandoff, TierStats,
    AttachArenas, Save, Load, DeviceCopy, EngineMove,
]  # fmt: skip
PayloadBody = Union[
    Pong, StatsReport, ProfileReport, Done,
    Configured, TierMiss, TierLoading, TierHit, TierSaveTicket, TierShed, Waited, TierCounters,
    Copied, Attached,
]  # fmt: skip


class Call(Wire, tag=4):
    call_id: int
    deadline_ns: int  # absolute time.monotonic_ns()
    body: RequestBody
    token: int = 0  # cancel token id; 0 = not cancellable
    session: int = 0  # the connection's session id (`Hello.session`)


class Ok(Wire, tag=10):
    call_id: int
    payload: PayloadBody

    def unwrap(self) -> Any:
        return self.payload


Reply = Union[Ok, Failed, Cancelled, PeerDead]
ClientMsg = Union[Hello, Call, Cancel, Heartbeat, Goodbye]
ServerMsg = Union[Welcome, Refused, Ok, Failed, Cancelled, PeerDead, HeartbeatAck, Goodbye]
StartupMsg = Union[Ready, StartupFailed]

REQUEST_TYPES: tuple[type[Request], ...] = get_args(RequestBody)
PAYLOAD_TYPES: tuple[type[Payload], ...] = get_args(PayloadBody)
TERMINAL_TYPES: tuple[type[Wire], ...] = (Ok, Failed, Cancelled, PeerDead)
ALL_TYPES: tuple[type[Wire], ...] = (
    Hello, Welcome, Refused, Call, Cancel, Heartbeat, HeartbeatAck, Goodbye,
    Ok, Failed, Cancelled, PeerDead, Ready, StartupFailed, *REQUEST_TYPES, *PAYLOAD_TYPES,
)  # fmt: skip


def tag_of(cls: type[Wire]) -> int:
    tag = cls.__struct_config__.tag
    assert isinstance(tag, int), cls
    return tag


def _check_tags() -> None:
    # Runs at import: a duplicated tag is a bug that must fail at boot, never as a misdecoded frame.
    seen: dict[int, str] = {}
    for cls in ALL_TYPES:
        tag = tag_of(cls)
        if tag in seen:
            raise RuntimeError(f"wire tag {tag} used by both {seen[tag]} and {cls.__name__}")
        seen[tag] = cls.__name__


_check_tags()

encoder = msgspec.msgpack.Encoder()
encode = encoder.encode


def server_decoder() -> msgspec.msgpack.Decoder[Any]:
    """Decoder for frames a server receives."""
    return msgspec.msgpack.Decoder(ClientMsg)


def client_decoder() -> msgspec.msgpack.Decoder[Any]:
    """Decoder for frames a client receives."""
    return msgspec.msgpack.Decoder(ServerMsg)


def startup_decoder() -> msgspec.msgpack.Decoder[Any]:
    return msgspec.msgpack.Decoder(StartupMsg)


def version_mismatch_message(client_version: int, server_version: int) -> str:
    return (
        f"protocol version mismatch: client speaks {client_version}, server speaks {server_version}; "
        "upgrade the older side"
    )
