"""The KV contract: what a model declares, and the validation that runs when it does.

A model states three things (reference design section 3): its `KvSpec` (page size and groups), its arenas (the
physical memory of each group, per rank) and, only if the stored layout differs from the execution layout, a
`repack` hook. Everything else -- allocation, the prefix index, checkpoints, tiers -- belongs to kvproc.

Every check here raises `KvContractError` naming the field and the offending value, at construction time, so a bad
declaration fails when the model is built and never as corrupted KV later.
"""

from __future__ import annotations

import enum
import inspect
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    # torch is imported lazily: processes that only route metadata (the host tier) must not pay ~2 s for it.
    import torch


class KvContractError(ValueError):
    """A model's KV declaration is invalid; the message names the field and the value."""


class GroupKind(enum.Enum):
    PAGED = "paged"  # append-only pages, sealed in place, shared by refcount
    BOUNDED = "bounded"  # fixed-size state rewritten every step, sealed by copy


class Sharding(enum.Enum):
    REPLICATED = "replicated"  # one rank stores, any rank restores
    PER_RANK = "per_rank"  # each rank stores and restores its own shard


# The rank that saves a REPLICATED model's KV (into the one tier every rank of the store loads from).
REPLICATED_SAVER_RANK = 0


class RepackDirection(enum.Enum):
    SAVE = "save"  # execution layout (device arena) -> stored layout (host tier)
    LOAD = "load"  # stored layout -> execution layout


@dataclass(frozen=True)
class GroupSpec:
    name: str
    kind: GroupKind
    sharding: Sharding = Sharding.PER_RANK
    # Stored or recomputable at a hit. A group that is neither turns prefix caching off for the model.
    checkpointable: bool = True
    # May be missing from a checkpoint without invalidating it (e.g. an MTP layer).
    optional: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise KvContractError(f"GroupSpec.name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.kind, GroupKind):
            raise KvContractError(f"GroupSpec.kind of group {self.name!r} must be a GroupKind, got {self.kind!r}")
        if not isinstance(self.sharding, Sharding):
            raise KvContractError(
                f"GroupSpec.sharding of group {self.name!r} must be a Sharding, got {self.sharding!r}"
            )


@dataclass(frozen=True)
class KvSpec:
    page_tokens: int
    groups: tuple[GroupSpec, ...]
    # The identity of the weights the KV is computed with (a checkpoint id such as "org/model@revision", or a digest
    # of the weights). Two engines of the same shape with other weights must never share KV: it is part of every page
    # hash and of the tier's and the hand-off's fingerprints, and a store with a tier refuses a spec without one.
    model_id: str = ""
    prefix_caching: bool = field(init=False)
    # Why prefix caching is off (None while it is on): shown in stats and miss reasons, never silent.
    prefix_caching_off_reason: str | None = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(self.groups))
        pt = self.page_tokens
        if isinstance(pt, bool) or not isinstance(pt, int) or pt <= 0 or pt & (pt - 1):
            raise KvContractError(f"KvSpec.page_tokens must be a positive power of two, got {pt!r}")
        if not self.groups:
            raise KvContractError("KvSpec.groups is empty: a model must declare at least one group")
        if not isinstance(self.model_id, str):
            raise KvContractError(f"KvSpec.model_id must be a string (the weights' identity), got {self.model_id!r}")
        seen: set[str] = set()
        for g in self.groups:
            if not isinstance(g, GroupSpec):
                raise KvContractError(f"KvSpec.groups must hold GroupSpec values, got {g!r}")
            if g.name in seen:
                raise KvContractError(f"KvSpec.groups has a duplicate group name {g.name!r}")
            seen.add(g.name)
        blocking = [g.name for g in self.groups if not g.checkpointable and not g.optional]
        reason = None
        if blocking:
            reason = (
                f"group(s) {', '.join(repr(n) for n in blocking)} are neither checkpointable nor optional: "
                "their state at a hit could be neither restored nor recomputed"
            )
        object.__setattr__(self, "prefix_caching", reason is None)
        object.__setattr__(self, "prefix_caching_off_reason", reason)

    def group(self, name: str) -> GroupSpec:
        for g in self.groups:
            if g.name == name:
                return g
        raise KvContractError(f"unknown group {name!r}; the spec declares {[g.name for g in self.groups]}")

    @cached_property
    def replicated(self) -> bool:
        """Every group is REPLICATED: each rank holds the same KV, so a multi-rank store keeps one copy of it (rank
        `REPLICATED_SAVER_RANK` saves it into one tier, from which every rank's resolve loads)."""
        return all(g.sharding is Sharding.REPLICATED for g in self.groups)

    def check_sharding(self, ranks: int) -> None:
        """Refuse a multi-rank store for a spec that mixes REPLICATED and PER_RANK groups: a page is stored as one
        unit (every group of it together), so it cannot be stored once for some groups and per rank for others."""
        rep = [g.name for g in self.groups if g.sharding is Sharding.REPLICATED]
        if ranks > 1 and rep and len(rep) != len(self.groups):
            per = [g.name for g in self.groups if g.sharding is not Sharding.REPLICATED]
            raise KvContractError(
                f"groups {rep} are REPLICATED and {per} PER_RANK: a {ranks}-rank store keeps a page (all its groups "
                "together) either once for every rank or once per rank; declare every group REPLICATED (each rank "
                "holds the same KV) or every group PER_RANK (each rank its own shard)")

    @cached_property  # the spec is frozen; read on every resolve
    def paged_groups(self) -> tuple[GroupSpec, ...]:
        return tuple(g for g in self.groups if g.kind is GroupKind.PAGED)

    @cached_property  # the spec is frozen; read on every resolve
    def bounded_groups(self) -> tuple[GroupSpec, ...]:
        return tuple(g for g in self.groups if g.kind is GroupKind.BOUNDED)

    @cached_property  # the spec is frozen; read on every resolve
    def restorable_bounded_groups(self) -> tuple[GroupSpec, ...]:
        """Bounded groups whose sealed copy is part of a checkpoint (checkpointable ones)."""
        return tuple(g for g in self.bounded_groups if g.checkpointable)


@dataclass(frozen=True, order=True)
class ArenaId:
    """Which arena a repack batch belongs to: its name, and its position among its group's arenas in the order
    `arenas(rank)` lists them. With one arena per layer that is the layer; with K and V as two arenas of one group
    (K0, V0, K1, V1, ...), layer i's K is index 2i and its V 2i + 1: use the name, or your own map, to tell them."""

    name: str
    index: int


_LAYOUT_NAME = re.compile(r"^[A-Za-z0-9_.@+-]{1,64}$")


@dataclass(frozen=True, eq=False)
class KvArena:
    """One physical region of a group: `num_blocks` blocks (pages, or slots for a bounded group), each
    `bytes_per_block` long, `block_stride` bytes apart, starting at byte 0 of `tensor`.

    `stored_layout` names the layout a block has in the tier (e.g. "mla-wire-v2") when it is not the execution
    layout; the model's `repack` hook then converts every block of this arena on every save and load, whatever the
    sizes (a transposed K of the same size is another layout). None: stored as executed, never repacked. The name is
    part of the tier's and the hand-off's fingerprints, so engines that store other layouts never exchange KV.
    `stored_bytes_per_block` is one block's size in that stored layout when it differs (only with a `stored_layout`).
    """

    name: str
    tensor: "torch.Tensor"
    num_blocks: int
    bytes_per_block: int
    block_stride: int
    stored_bytes_per_block: int | None = None
    stored_layout: str | None = None

    def __post_init__(self) -> None:
        import torch

        where = f"arena {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise KvContractError(f"KvArena.name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.tensor, torch.Tensor):
            raise KvContractError(f"{where}: KvArena.tensor must be a torch.Tensor, got {type(self.tensor).__name__}")
        for fname in ("num_blocks", "bytes_per_block", "block_stride"):
            v = getattr(self, fname)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise KvContractError(f"{where}: KvArena.{fname} must be a positive int, got {v!r}")
        if self.bytes_per_block > self.block_stride:
            raise KvContractError(
                f"{where}: KvArena.bytes_per_block={self.bytes_per_block} exceeds block_stride={self.block_stride}"
            )
        if not self.tensor.is_contiguous():
            raise KvContractError(f"{where}: KvArena.tensor must be contiguous (blocks are addressed by byte offset)")
        need = (self.num_blocks - 1) * self.block_stride + self.bytes_per_block
        have = self.tensor.numel() * self.tensor.element_size()
        if have < need:
            raise KvContractError(
                f"{where}: KvArena.tensor holds {have} bytes, needs (num_blocks-1)*block_stride+bytes_per_block"
                f" = {need}"
            )
        sb = self.stored_bytes_per_block
        if sb is not None and (isinstance(sb, bool) or not isinstance(sb, int) or sb <= 0):
            raise KvContractError(f"{where}: KvArena.stored_bytes_per_block must be a positive int, got {sb!r}")
        sl = self.stored_layout
        if sl is not None and (not isinstance(sl, str) or not _LAYOUT_NAME.match(sl)):
            raise KvContractError(f"{where}: KvArena.stored_layout must be a layout name of 1-64 characters of "
                                  f"[A-Za-z0-9_.@+-] (e.g. 'mla-wire-v2'), got {sl!r}")
        if sl is None and sb is not None and sb != self.bytes_per_block:
            raise KvContractError(
                f"{where}: stored_bytes_per_block={sb} differs from bytes_per_block={self.bytes_per_block} but no "
                "stored_layout is declared; name the stored layout (KvArena(..., stored_layout='my-layout-v1')) so "
                "the repack hook runs for it and the fingerprint tells engines that store it apart")

    @property
    def stored_bytes(self) -> int:
        return self.stored_bytes_per_block or self.bytes_per_block

    @property
    def repacked(self) -> bool:
        """Whether blocks go through the model's repack hook (a declared stored layout), whatever the sizes."""
        return self.stored_layout is not None

    @property
    def layout_tag(self) -> str:
        """`name:stored bytes:stored layout` ("-": as executed): this arena's entry in the fingerprints."""
        return f"{self.name}:{self.stored_bytes}:{self.stored_layout or '-'}"

    def byte_view(self) -> "torch.Tensor":
        """The arena as a flat uint8 tensor (zero-copy)."""
        import torch

        return self.tensor.view(-1).view(torch.uint8)


@runtime_checkable
class KvModel(Protocol):
    """What a model implements. `repack` has a default no-op for models whose stored layout is the execution one."""

    def spec(self) -> KvSpec: ...

    def arenas(self, rank: int) -> Sequence[tuple[str, KvArena]]: ...

    def repack(self, group: str, direction: RepackDirection, src: "torch.Tensor", dst: "torch.Tensor",
               arena: ArenaId) -> None:
        """Convert `src` rows (one block each of arena `arena` of group `group`) into `dst` rows. Called for every
        arena that declares a `stored_layout`. The default copies bytes unchanged."""
        dst.copy_(src)


RepackHook = Callable[[str, RepackDirection, "torch.Tensor", "torch.Tensor", ArenaId], None]


def check_repack_hook(fn: Any, who: str) -> RepackHook:
    """`fn` as a repack hook, or a `KvContractError` with the fix: it must take (group, direction, src, dst, arena)."""
    if not callable(fn):
        raise KvContractError(f"{who}: the repack hook {fn!r} is not callable")
    try:
        inspect.signature(fn).bind("g", RepackDirection.SAVE, None, None, ArenaId("a", 0))
    except TypeError:
        raise KvContractError(
            f"{who}: the repack hook {getattr(fn, '__qualname__', fn)!r} must take (group, direction, src, dst, arena)"
            " (arena: an ArenaId(name, index)); add the `arena` parameter") from None
    except ValueError:  # no signature to read (a builtin): it is called as declared
        pass
    return fn


@dataclass(frozen=True)
class ArenaLayout:
    """A validated spec + arenas for one rank: what pools, copy workers and tiers are built from."""

    spec: KvSpec
    arenas: tuple[tuple[str, KvArena], ...]
    num_paged_blocks: int  # shared block-id space of all (aligned) paged groups; 0 without paged groups
    bounded_slots: dict[str, int]  # group -> slot count (the smallest arena of the group bounds it)

    def group_arenas(self, group: str) -> list[KvArena]:
        return [a for g, a in self.arenas if g == group]

    def stored_bytes_per_block(self, group: str) -> int:
        """Bytes one block (or slot) of `group` takes in the stored layout, summed over its arenas."""
        return sum(a.stored_bytes for a in self.group_arenas(group))

    def arena_id(self, name: str) -> ArenaId:
        """The arena's name and its position among its group's arenas (what its repack batches are called with)."""
        group = next(g for g, a in self.arenas if a.name == name)
        return ArenaId(name, [a.name for a in self.group_arenas(group)].index(name))

    @property
    def repacked_arenas(self) -> list[str]:
        return [a.name for _, a in self.arenas if a.repacked]


def check_hooks_agree(model: KvModel, hook: RepackHook, layout: ArenaLayout, path: str) -> None:
    """A copy worker runs the hook at `path` (it cannot call the model instance); the model's own `repack` is what
    the in-process store and the author's tests run. Refuse a pair that disagrees (the hook written twice, one copy
    stale): both repack the same rows (two blocks of each repacked arena, random bytes, SAVE) and must produce the
    same bytes, or raise the same exception type."""
    import torch

    gen = torch.Generator().manual_seed(0)
    for group, arena in layout.arenas:
        if not arena.repacked:
            continue
        ident = layout.arena_id(arena.name)
        src = torch.randint(0, 256, (2, arena.bytes_per_block), dtype=torch.uint8, generator=gen)
        outs: list[Any] = []
        for fn in (model.repack, hook):
            dst = torch.zeros((2, arena.stored_bytes), dtype=torch.uint8)
            try:
                fn(group, RepackDirection.SAVE, src.clone(), dst, ident)
                outs.append(dst)
            except Exception as e:  # noqa: BLE001 - compared, not handled
                outs.append(type(e))
        same = (isinstance(outs[0], type) and outs[0] is outs[1]) or (
            not isinstance(outs[0], type) and not isinstance(outs[1], type) and torch.equal(outs[0], outs[1]))
        if not same:
            raise KvContractError(
                f"{type(model).__name__}.repack and the copy workers' hook {path!r} disagree on arena {arena.name!r} "
                f"(group {group!r}): one hook, written twice; make {type(model).__name__}.repack call the function "
                f"at {path!r} (or the other way round)")


def require_model_id(spec: KvSpec, who: str) -> str:
    """The spec's model identity, or a `KvContractError` saying how to declare one (a store whose KV leaves the
    process -- a tier, a hand-off -- needs it: without it two fine-tunes of one shape would serve each other's KV)."""
    if not spec.model_id:
        raise KvContractError(
            f"{who}: KvSpec.model_id is empty; declare the identity of the weights the KV is computed "
            "with, e.g. KvSpec(page_tokens, groups, model_id='org/model@revision') or a digest of the checkpoint: "
            "engines with other weights must never share KV through a tier")
    return spec.model_id


def _check_disjoint(pairs: Sequence[tuple[str, KvArena]]) -> None:
    """Refuse arenas (of any groups) whose byte ranges overlap: a copy into one would overwrite blocks of the other.
    An arena spans [data_ptr, data_ptr + (num_blocks-1)*block_stride + bytes_per_block) of its device's memory.
    Sort by start, then each arena must start at or after the furthest end seen so far: O(n log n)."""
    spans = sorted(
        (str(a.tensor.device), a.tensor.data_ptr(), a.tensor.data_ptr() + (a.num_blocks - 1) * a.block_stride
         + a.bytes_per_block, g, a.name)
        for g, a in pairs
    )
    far: tuple[str, int, int, str, str] | None = None  # the furthest-reaching arena so far (a span like `spans`')
    for span in spans:
        device, start, end, group, name = span
        if far is not None and far[0] == device and start < far[2]:
            raise KvContractError(
                f"arena {name!r} (group {group!r}) overlaps arena {far[4]!r} (group {far[3]!r}) on {device}: bytes "
                f"[{start:#x}, {end:#x}) and [{far[1]:#x}, {far[2]:#x}); every arena needs its own memory")
        if far is None or far[0] != device or end > far[2]:
            far = span


def validate_layout(spec: KvSpec, arenas: Sequence[tuple[str, KvArena]] | Any) -> ArenaLayout:
    """Check a rank's arenas against the spec; raise `KvContractError` naming the field and value."""
    pairs = tuple(arenas)
    names: set[str] = set()
    known = {g.name: g for g in spec.groups}
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[1], KvArena)):
            raise KvContractError(f"arenas must be (group name, KvArena) pairs, got {pair!r}")
        group, arena = pair
        if group not in known:
            raise KvContractError(f"arena {arena.name!r} names unknown group {group!r}; known: {sorted(known)}")
        if arena.name in names:
            raise KvContractError(f"duplicate arena name {arena.name!r}")
        names.add(arena.name)
    _check_disjoint(pairs)
    paged_counts: dict[int, list[str]] = {}
    bounded_slots: dict[str, int] = {}
    for g in spec.groups:
        mine = [a for gn, a in pairs if gn == g.name]
        if not mine:
            kind = "bounded" if g.kind is GroupKind.BOUNDED else "paged"
            raise KvContractError(f"{kind} group {g.name!r} has no arena")
        if g.kind is GroupKind.PAGED:
            for a in mine:
                paged_counts.setdefault(a.num_blocks, []).append(a.name)
        else:
            counts = {a.num_blocks for a in mine}
            if len(counts) != 1:
                raise KvContractError(
                    f"bounded group {g.name!r}: its arenas declare different num_blocks {sorted(counts)};"
                    " one slot spans every arena of the group"
                )
            bounded_slots[g.name] = counts.pop()
    if len(paged_counts) > 1:
        detail = ", ".join(f"{n} blocks: {names_}" for n, names_ in sorted(paged_counts.items()))
        raise KvContractError(
            f"aligned paged arenas must share one block-id space, but num_blocks differ ({detail})"
        )
    num_paged = next(iter(paged_counts)) if paged_counts else 0
    return ArenaLayout(spec=spec, arenas=pairs, num_paged_blocks=num_paged, bounded_slots=bounded_slots)
