"""One engine request (one conversation turn) and what the engine records about it.

The request carries only what the client asked for and what was observed (tokens, times, hit lengths). Its KV lives
in kvproc (`RequestKv`, `SealCursor`, `KvPrefix`), never here: the engine keeps no KV book-keeping of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvproc.store.handoff import HandoffEnvelope


@dataclass(eq=False)  # identity: a request is one object moving through the engine
class Request:
    req_id: str
    prompt: np.ndarray  # int64 token ids: the whole history of the conversation plus the new user tokens
    max_output_tokens: int
    stop_on_eos: bool = False  # benchmarks ignore EOS so every turn has the same output length
    keep_logits: bool = False  # tests compare the logits of every sampled token across runs
    # -- observed -------------------------------------------------------------------------------------------------
    submitted_at: float = 0.0
    ready_at: float | None = None  # resolve finished (or no resolve): entered the inbox
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    output: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    failed: str | None = None  # why the request was rejected (admission can never honour it)
    # -- P/D hand-off (kvproc/store/handoff.py) ----------------------------------------------------------------------
    handoff_out: bool = False  # prefill side: stop after the first token, pad, seal with Handoff, emit `envelope`
    handoff_in: HandoffEnvelope | None = None  # decode side: continue from the producer's KV, never recompute it
    envelope: HandoffEnvelope | None = None  # set by the prefill side when the hand-off is emitted
    # decode side: prompt tokens it computed itself because the hand-off's KV was not all in the store (0: none)
    handoff_recomputed: int = 0

    @classmethod
    def make(cls, req_id: str, prompt: Sequence[int] | np.ndarray, max_output_tokens: int, **kw: object) -> Request:
        arr = np.asarray(prompt, dtype=np.int64).reshape(-1)
        if arr.size == 0:
            raise ValueError(f"request {req_id!r}: empty prompt")
        if max_output_tokens <= 0:
            raise ValueError(f"request {req_id!r}: max_output_tokens must be positive, got {max_output_tokens}")
        return cls(req_id, arr, max_output_tokens, **kw)  # type: ignore[arg-type]

    @property
    def prompt_tokens(self) -> int:
        return int(self.prompt.size)

    @property
    def computed_prompt_tokens(self) -> int:
        return self.prompt_tokens - self.device_hit_tokens - self.host_hit_tokens

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.submitted_at

    @property
    def done(self) -> bool:
        return self.finished_at is not None
