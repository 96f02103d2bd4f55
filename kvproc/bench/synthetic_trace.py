"""A seeded multi-turn chat trace in the Mooncake format (`TraceRequest`s of 512-token block ids).

Why another trace: one real trace can flatter a policy tuned on it. This one has a different shape, chosen so the
policies' ranking is tested on something else: several system prompts of Zipf popularity (not one), conversations
arriving as a Poisson process, a geometric number of turns (mean `mean_turns`), lognormal think times between turns,
and each turn's prompt = the previous prompt + the previous answer + the new user message (so turn k+1 extends turn k
as a prefix, as in the conversation trace). Pure function of its arguments: the same seed gives the same trace.
"""

from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kvproc.bench.replay import TraceRequest

TRACE_BLOCK = 512


def synthetic_trace(*, requests: int = 12000, seed: int = 0, system_prompts: int = 8, system_blocks: int = 2,
                    mean_turns: float = 4.0, rate_per_s: float = 3.4, think_s: float = 120.0,
                    first_blocks: float = 8.0, new_blocks_per_turn: float = 3.0) -> list[TraceRequest]:
    from kvproc.bench.replay import TraceRequest

    rng = np.random.default_rng(seed)
    next_id = system_prompts * system_blocks
    # Zipf-ish popularity over the system prompts (the first one the most used)
    weights = 1.0 / np.arange(1, system_prompts + 1)
    weights /= weights.sum()
    conv_rate = rate_per_s / mean_turns  # conversations per second, so requests per second ~ rate_per_s
    events: list[tuple[float, int, int]] = []  # (time s, conversation, turn)
    histories: list[list[int]] = []
    turns_left: list[int] = []
    t = 0.0
    conv = 0
    out: list[TraceRequest] = []
    # Conversations start until enough turns are scheduled; the heap interleaves everyone's turns by time.
    while len(out) < requests:
        if not events or t <= events[0][0]:
            sp = int(rng.choice(system_prompts, p=weights))
            histories.append(list(range(sp * system_blocks, (sp + 1) * system_blocks)))
            turns_left.append(int(rng.geometric(1.0 / mean_turns)))
            heapq.heappush(events, (t, conv, 0))
            conv += 1
            t += float(rng.exponential(1.0 / conv_rate))
            continue
        when, c, turn = heapq.heappop(events)
        grow = max(1, int(rng.poisson(first_blocks if turn == 0 else new_blocks_per_turn)))
        histories[c].extend(range(next_id, next_id + grow))
        next_id += grow
        blocks = tuple(histories[c])
        tail = int(rng.integers(1, TRACE_BLOCK + 1))  # the last block is partly filled
        out.append(TraceRequest(int(when * 1000), (len(blocks) - 1) * TRACE_BLOCK + tail,
                                int(rng.integers(50, 500)), blocks))
        turns_left[c] -= 1
        if turns_left[c] > 0:
            heapq.heappush(events, (when + float(rng.lognormal(math.log(think_s), 1.0)), c, turn + 1))
        else:
            histories[c] = []  # the conversation is over: its history is garbage
    return out
