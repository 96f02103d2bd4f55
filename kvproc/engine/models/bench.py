"""Measure a 1024-token prefill and a batch-16 decode step per model.

    .venv/bin/python -m kvproc.engine.models.bench [names...]
"""

from __future__ import annotations

import sys
import time

import torch

from kvproc.engine.models import MODEL_NAMES, SeqBatchItem, TinyModel, build_model


def _slots(model: TinyModel, slot: int) -> dict[str, int]:
    return {g.name: slot for g in model.spec().bounded_groups}


def bench(name: str, prefill: int = 1024, batch: int = 16, context: int = 512, reps: int = 5) -> tuple[float, float]:
    """(prefill ms, decode-step ms), best of `reps`; decode sequences each hold `context` tokens already."""
    pt = 16
    per_seq = (max(prefill, context) + 64) // pt + 1
    model = build_model(name, num_blocks=per_seq * batch, num_slots=batch)
    gen = torch.Generator().manual_seed(0)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    prompt = torch.randint(0, model.vocab_size, (prefill,), generator=gen)
    best_p = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        model.forward([SeqBatchItem(prompt, 0, tables[0], _slots(model, 0))])
        best_p = min(best_p, time.perf_counter() - t0)
    # Fill each decode sequence's context in one prefill, then time single-token steps.
    ctx_tokens = torch.randint(0, model.vocab_size, (batch, context), generator=gen)
    for i in range(batch):
        model.forward([SeqBatchItem(ctx_tokens[i], 0, tables[i], _slots(model, i))])
    best_d = float("inf")
    step = torch.randint(0, model.vocab_size, (reps, batch), generator=gen)
    for r in range(reps):
        items = [SeqBatchItem(step[r, i : i + 1], context + r, tables[i], _slots(model, i)) for i in range(batch)]
        t0 = time.perf_counter()
        model.forward(items)
        best_d = min(best_d, time.perf_counter() - t0)
    return best_p * 1e3, best_d * 1e3


def main(argv: list[str]) -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name in argv or MODEL_NAMES:
        p, d = bench(name)
        print(f"{name:7s} prefill 1024 tokens: {p:7.1f} ms   decode step, batch 16 @ 512 context: {d:6.1f} ms")


if __name__ == "__main__":
    main(sys.argv[1:])
