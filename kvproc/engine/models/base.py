"""Shared machinery of the tiny models: arenas from an allocator, batch validation, seeded weights.

Every model keeps ALL of its KV in kvproc arenas: forward writes the new tokens' rows into paged blocks / bounded
slots and reads every earlier position back from them, never from a Python-side cache. That is what lets kvproc
restore a prefix by copying bytes and have the model continue as if it had computed the prefix itself.
"""

from __future__ import annotations

import abc
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvproc.contract import ArenaId, GroupKind, KvArena, KvSpec, RepackDirection
from kvproc.engine.step_events import StepEvents

# Reserved pad id kvproc may put in a page's token list (P/D hand-off padding); outside every model's vocabulary.
PAD_TOKEN_ID = 2**31 - 1

Allocator = Callable[[str, int], torch.Tensor]


def default_allocator(name: str, nbytes: int) -> torch.Tensor:
    """(arena name, nbytes) -> a zeroed, contiguous uint8 tensor on the CPU."""
    del name
    return torch.zeros(nbytes, dtype=torch.uint8)


DEVICES = ("cpu", "cuda")  # what `--device` offers (a model also takes "cuda:N")


def model_device(device: str | torch.device) -> torch.device:
    """The device a model runs on: "cpu", or a CUDA device where one is present; anything else is a clear error."""
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"unknown device {device!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} needs a CUDA device, and torch.cuda.is_available() is False here; "
                         "run on cpu")
    if dev.type not in DEVICES:
        raise ValueError(f"device {device!r}: the reference models run on {' or '.join(DEVICES)}")
    return dev


@dataclass
class SeqBatchItem:
    token_ids: list[int] | torch.Tensor  # the NEW tokens to compute this step
    start_pos: int  # tokens of this sequence whose KV is already in the arenas
    block_ids: list[int] | torch.Tensor  # block_ids[p // page_tokens] holds position p's paged KV
    slots: dict[str, int] = field(default_factory=dict)  # bounded group -> LIVE slot index


@dataclass
class PreparedItem:
    """A validated batch item with the index tensors every layer needs, computed once per forward."""

    tokens: torch.Tensor  # long [T]
    start: int
    length: int  # T, new tokens
    positions: torch.Tensor  # long [T], absolute positions start..start+T-1
    write_rows: torch.Tensor  # long [T], flat row index block*page_tokens + offset of each new position
    read_blocks: torch.Tensor  # long [nb], blocks covering positions [0, start+T)
    slots: dict[str, int]

    @property
    def total(self) -> int:
        return self.start + self.length


class Rng:
    """Seeded weight factory: a fixed creation order over one generator makes two instances bit-identical."""

    def __init__(self, seed: int, device: torch.device | None = None) -> None:
        # weights are drawn on the CPU (the same bits everywhere), then moved to `device`
        self.device = device if device is not None else torch.device("cpu")
        self.gen = torch.Generator().manual_seed(seed)
        self._digest = hashlib.blake2b(digest_size=8)  # of every weight made: the model's identity (`KvSpec.model_id`)

    def normal(self, *shape: int, std: float) -> torch.Tensor:
        t = torch.randn(*shape, generator=self.gen, dtype=torch.float32) * std
        self._digest.update(t.numpy().data)  # the buffer itself: no copy
        return t if self.device.type == "cpu" else t.to(self.device)

    def weights_digest(self) -> str:
        return self._digest.hexdigest()

    def linear(self, fan_in: int, fan_out: int, gain: float = 1.0) -> torch.Tensor:
        """A [fan_in, fan_out] weight (x @ W) with variance-preserving scale."""
        return self.normal(fan_in, fan_out, std=gain / fan_in**0.5)

    def norm(self, dim: int) -> torch.Tensor:
        # Near 1 but not exactly, so a norm applied to the wrong tensor changes logits.
        return 1.0 + self.normal(dim, std=0.05)


def as_long(x: list[int] | torch.Tensor, what: str) -> torch.Tensor:
    t = x.to(torch.long).reshape(-1) if isinstance(x, torch.Tensor) else torch.tensor(list(x), dtype=torch.long)
    if t.dim() != 1:
        raise ValueError(f"{what} must be one-dimensional")
    return t


class TinyModel(abc.ABC):
    """A small seeded model implementing `kvproc.KvModel` with a real forward pass over its arenas."""

    name: str
    vocab_size: int
    eos_token_id: int

    def __init__(
        self,
        num_blocks: int,
        num_slots: int,
        *,
        page_tokens: int = 16,
        seed: int = 0,
        allocator: Allocator = default_allocator,
        device: str = "cpu",
    ) -> None:
        if num_blocks <= 0 or num_slots <= 0:
            raise ValueError(f"num_blocks and num_slots must be positive, got {num_blocks}, {num_slots}")
        self.num_blocks = num_blocks
        self.num_slots = num_slots
        self.page_tokens = page_tokens
        self.seed = seed
        # Where weights, arenas and every step's tensors live. NEEDS-GPU-CHECK: "cuda" has never run (no GPU where
        # it was written); on the CPU nothing below changes what runs.
        self.device = model_device(device)
        self._allocator = allocator
        if allocator is default_allocator and self.device.type != "cpu":
            self._allocator = self._device_allocator
        self._arenas: list[tuple[str, KvArena]] = []
        self._rng = Rng(seed, self.device)
        # On a GPU: the event recorded after each step, which the store's saves wait on (`step_fence_of`). NEVER RUN.
        self.step_events = StepEvents(self.device) if self.device.type == "cuda" else None

    def _device_allocator(self, name: str, nbytes: int) -> torch.Tensor:
        """The default allocator on a GPU: zeroed uint8 arenas on the model's device."""
        del name
        return torch.zeros(nbytes, dtype=torch.uint8, device=self.device)

    @property
    def model_id(self) -> str:
        """The identity of these weights (a digest of every weight the seeded factory made): two tiny models share
        KV only if their weights are bit-identical."""
        return f"kvproc-tiny/{self.name}@{self._rng.weights_digest()}"

    # --- KvModel -------------------------------------------------------------------------------------------------

    @abc.abstractmethod
    def spec(self) -> KvSpec: ...

    def arenas(self, rank: int) -> list[tuple[str, KvArena]]:
        if rank != 0:
            raise ValueError(f"{self.name}: tiny models are single-rank; arenas(rank={rank}) asked for rank != 0")
        return list(self._arenas)

    def repack(self, group: str, direction: RepackDirection, src: torch.Tensor, dst: torch.Tensor,
               arena: ArenaId) -> None:
        """Groups without a wire layout store their execution bytes unchanged."""
        self.spec().group(group)  # unknown group -> KvContractError naming it
        RepackDirection(direction)
        if src.shape != dst.shape:
            raise ValueError(f"{self.name}: repack of group {group!r} copies bytes, but src {tuple(src.shape)}"
                             f" != dst {tuple(dst.shape)}")
        dst.copy_(src)

    # --- engine API ----------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: Sequence[SeqBatchItem]) -> torch.Tensor:
        """float32 logits [len(batch), vocab] at the last new position of each item."""
        if not batch:
            raise ValueError(f"{self.name}: forward got an empty batch")
        if self.device.type == "cpu":
            return self._forward(self._prepare(batch))
        with self.device:  # every tensor a step makes (masks, indices, outputs) on the model's device
            logits = self._forward(self._prepare(batch))
        if self.step_events is not None:  # after the step's kernels, on its stream: what a save of its pages waits on
            self.step_events.record()
        return logits

    def reset_slot(self, group: str, slot: int) -> None:
        """Zero a live slot in every arena of a bounded group (zeros are every model's initial state)."""
        g = self.spec().group(group)
        if g.kind is not GroupKind.BOUNDED:
            raise ValueError(f"{self.name}: reset_slot needs a bounded group, {group!r} is {g.kind.value}")
        self._check_slot(group, slot)
        for gname, arena in self._arenas:
            if gname == group:
                arena.byte_view()[slot * arena.block_stride : slot * arena.block_stride + arena.bytes_per_block] = 0

    # --- helpers for subclasses ----------------------------------------------------------------------------------

    @abc.abstractmethod
    def _forward(self, items: list[PreparedItem]) -> torch.Tensor: ...

    def _bounded_groups(self) -> tuple[str, ...]:
        return tuple(g.name for g in self.spec().bounded_groups)

    def _has_paged(self) -> bool:
        return bool(self.spec().paged_groups)

    def _alloc(self, group: str, arena_name: str, num_blocks: int, floats_per_block: int,
               stored_bytes_per_block: int | None = None, stored_layout: str | None = None) -> torch.Tensor:
        """Allocate one arena of float32 blocks; returns its float32 view [num_blocks, floats_per_block]."""
        nbytes = num_blocks * floats_per_block * 4
        raw = self._allocator(arena_name, nbytes)
        if raw.dtype != torch.uint8 or raw.numel() != nbytes or not raw.is_contiguous():
            raise ValueError(f"allocator returned {raw.dtype} x {raw.numel()} for arena {arena_name!r};"
                             f" expected a contiguous uint8 tensor of {nbytes} bytes")
        arena = KvArena(name=arena_name, tensor=raw, num_blocks=num_blocks, bytes_per_block=floats_per_block * 4,
                        block_stride=floats_per_block * 4, stored_bytes_per_block=stored_bytes_per_block,
                        stored_layout=stored_layout)
        self._arenas.append((group, arena))
        return raw.view(torch.float32).view(num_blocks, floats_per_block)

    def _check_slot(self, group: str, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise ValueError(f"{self.name}: slot {slot!r} of group {group!r} is outside [0, {self.num_slots})")

    def _prepare(self, batch: Sequence[SeqBatchItem]) -> list[PreparedItem]:
        pt = self.page_tokens
        paged = self._has_paged()
        bounded = self._bounded_groups()
        used_slots: set[tuple[str, int]] = set()
        out: list[PreparedItem] = []
        for i, item in enumerate(batch):
            tokens = as_long(item.token_ids, f"batch[{i}].token_ids").to(self.device)
            n = tokens.numel()
            if n == 0:
                raise ValueError(f"{self.name}: batch[{i}] has no new tokens to compute")
            bad = (tokens < 0) | (tokens >= self.vocab_size)
            if bool(bad.any()):
                tok = int(tokens[bad][0])
                hint = " (the reserved pad id, never computed)" if tok == PAD_TOKEN_ID else ""
                raise ValueError(f"{self.name}: batch[{i}] token id {tok}{hint} is outside [0, {self.vocab_size})")
            start = int(item.start_pos)
            if start < 0:
                raise ValueError(f"{self.name}: batch[{i}].start_pos={start} is negative")
            positions = torch.arange(start, start + n, dtype=torch.long)
            write_rows = read_blocks = positions  # placeholders for models without paged groups
            if paged:
                need = (start + n + pt - 1) // pt
                blocks = as_long(item.block_ids, f"batch[{i}].block_ids").to(self.device)
                if blocks.numel() < need:
                    raise ValueError(f"{self.name}: batch[{i}] covers {start + n} positions, needs {need} block ids,"
                                     f" got {blocks.numel()}")
                read_blocks = blocks[:need]
                if bool(((read_blocks < 0) | (read_blocks >= self.num_blocks)).any()):
                    raise ValueError(f"{self.name}: batch[{i}] block ids {read_blocks.tolist()} leave"
                                     f" [0, {self.num_blocks})")
                write_rows = read_blocks[positions // pt] * pt + positions % pt
            slots = dict(item.slots)
            for g in bounded:
                if g not in slots:
                    raise ValueError(f"{self.name}: batch[{i}] has no live slot for bounded group {g!r}")
                self._check_slot(g, slots[g])
                if (g, slots[g]) in used_slots:
                    raise ValueError(f"{self.name}: slot {slots[g]} of group {g!r} is used twice in one batch")
                used_slots.add((g, slots[g]))
            out.append(PreparedItem(tokens, start, n, positions, write_rows, read_blocks, slots))
        return out
