"""A multi-turn chat workload and the client driver that feeds it to the engine.

Shape (defaults of `kvproc demo`, like a multi-turn serving benchmark): `conversations` conversations of `turns`
turns; the first turn has `first_input` user tokens, every later turn adds `new_per_turn`; every turn generates
`output_per_turn` tokens (EOS ignored, as benchmarks do). A turn's prompt is the whole history: previous prompt +
previous output + the new user tokens, so later turns can hit the prefix cache.

Clients: `concurrency` clients, each owning `conversations / concurrency` conversations (all active at once, like
users who come back after a think time). A client has one turn in flight at a time; when it completes, the client
picks its next conversation at random among its unfinished ones (seeded per client, so the order of each client's
turns is the same in every run, while the global interleaving follows the engine's speed). The working set is then
every conversation, not only the ones running: that is what a device pool cannot hold and a host tier can.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from kvproc.engine.pd import EngineLike
from kvproc.engine.request import Request


@dataclass(frozen=True)
class WorkloadSpec:
    conversations: int = 48
    turns: int = 5
    first_input: int = 1024
    new_per_turn: int = 256
    output_per_turn: int = 128
    concurrency: int = 16
    seed: int = 0

    def scaled(self, scale: float) -> WorkloadSpec:
        """Token counts times `scale` (conversations, turns and concurrency unchanged)."""
        def s(n: int) -> int:
            return max(1, round(n * scale))
        return WorkloadSpec(self.conversations, self.turns, s(self.first_input), s(self.new_per_turn),
                            s(self.output_per_turn), self.concurrency, self.seed)

    def prompt_tokens(self, turn: int) -> int:
        return self.first_input + turn * (self.output_per_turn + self.new_per_turn)

    @property
    def max_turn_tokens(self) -> int:
        """Prompt + output of the last (longest) turn."""
        return self.prompt_tokens(self.turns - 1) + self.output_per_turn

    @property
    def total_turns(self) -> int:
        return self.conversations * self.turns


@dataclass(frozen=True)
class TurnRecord:
    conversation: int
    turn: int
    ttft_s: float | None
    submitted_at: float
    finished_at: float
    prompt_tokens: int
    device_hit_tokens: int
    host_hit_tokens: int
    output: tuple[int, ...]
    failed: str | None
    logits: tuple[torch.Tensor, ...] = ()  # only with drive(keep_logits=True)


@dataclass
class _Conversation:
    index: int
    user_turns: list[np.ndarray]
    history: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    next_turn: int = 0
    aborted: bool = False

    @property
    def finished(self) -> bool:
        return self.aborted or self.next_turn >= len(self.user_turns)


def make_conversations(spec: WorkloadSpec, vocab_size: int) -> list[_Conversation]:
    """Seeded user tokens in [2, vocab): ids 0 and 1 (EOS) never appear in user text."""
    rng = np.random.default_rng(spec.seed)
    out = []
    for c in range(spec.conversations):
        turns = [rng.integers(2, vocab_size, size=spec.first_input if t == 0 else spec.new_per_turn, dtype=np.int64)
                 for t in range(spec.turns)]
        out.append(_Conversation(c, turns))
    return out


def drive(engine: EngineLike, spec: WorkloadSpec, vocab_size: int,
          on_turn: Callable[[TurnRecord], None] | None = None, keep_logits: bool = False) -> list[TurnRecord]:
    """Run the whole workload through `engine`; returns one record per turn (failed ones included)."""
    convs = make_conversations(spec, vocab_size)
    clients: list[list[_Conversation]] = [convs[i :: spec.concurrency] for i in range(spec.concurrency)]
    pickers = [random.Random(spec.seed * 1_000_003 + i) for i in range(spec.concurrency)]
    owner: dict[str, tuple[int, _Conversation]] = {}
    records: list[TurnRecord] = []

    def issue(client: int) -> None:
        todo = [c for c in clients[client] if not c.finished]
        if not todo:
            return
        conv = pickers[client].choice(todo)
        t = conv.next_turn
        prompt = np.concatenate([conv.history, conv.user_turns[t]])
        req = Request.make(f"c{conv.index}-t{t}", prompt, spec.output_per_turn, keep_logits=keep_logits)
        owner[req.req_id] = (client, conv)
        engine.submit(req)

    def record(req: Request, conv: _Conversation, turn: int) -> TurnRecord:
        return TurnRecord(conv.index, turn, req.ttft_s, req.submitted_at, req.finished_at or 0.0,
                          req.prompt_tokens, req.device_hit_tokens, req.host_hit_tokens, tuple(req.output),
                          req.failed, tuple(req.logits))

    for client in range(spec.concurrency):
        issue(client)
    while engine.has_work:
        for req in engine.step():
            client, conv = owner.pop(req.req_id)
            turn = conv.next_turn
            rec = record(req, conv, turn)
            records.append(rec)
            if req.failed is not None:
                # A rejected turn ends its conversation: the later turns need its output. They count as failed.
                conv.aborted = True
                for t in range(turn + 1, spec.turns):
                    records.append(TurnRecord(conv.index, t, None, 0.0, 0.0, 0, 0, 0, (), "conversation aborted"))
            else:
                conv.history = np.concatenate([req.prompt, np.asarray(req.output, dtype=np.int64)])
                conv.next_turn += 1
            if on_turn is not None:
                on_turn(rec)
            issue(client)
    return records
