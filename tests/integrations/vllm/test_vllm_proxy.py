"""`kvproc proxy` in front of two real `vllm serve` processes (a kv_producer and a kv_consumer with kvproc's
connector, one shared `kvproc up` tier): the client's completions and chat completions, streamed or not, carry the
tokens of one vLLM engine alone, and the consumer computes no prompt token (sync scheduling: vLLM's CPU platform turns
async off, `test_vllm_pd_async.py` covers it in-process); either side failing is an HTTP error, never a hang; and a
server stopped by SIGTERM leaves nothing in /dev/shm.

The reference is the session's multi-turn workload on vLLM alone (conftest's `reference`: already computed when the
folder runs), so the test's own cost is the two servers' start-up.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil
import pytest

from kvproc.integrations.vllm.tiny_llama import FIRST_WORD, words
from kvproc.ipc.segment import sweep_dead_segments
from tests.integrations.vllm.conftest import BLOCK, MAX_LEN, VLLM_BLOCKS, kvproc_transfer_config, random_tokens

pytestmark = pytest.mark.timeout(600)

MAX_TOKENS = 16  # the reference's


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# The tiny Llama's engine arguments (conftest's `engine` defaults)
LLAMA_ARGS = ("--dtype", "float32", "--max-model-len", str(MAX_LEN), "--block-size", str(BLOCK),
              "--num-gpu-blocks-override", str(VLLM_BLOCKS))


def _serve(model: Path, role: str, tier: str, port: int, log: Path,
           model_args: Sequence[str] = LLAMA_ARGS) -> subprocess.Popen[bytes]:
    cfg = kvproc_transfer_config(tier_runtime_dir=tier)
    cfg["kv_role"] = role
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
            "--host", "127.0.0.1", "--enforce-eager", *model_args, "--max-num-seqs", "2", "--enable-prefix-caching",
            "--no-async-scheduling", "--seed", "0", "--kv-transfer-config", json.dumps(cfg)]
    # VLLM_ENABLE_V1_MULTIPROCESSING=0 (conftest sets it too): on CPU the model runs in the engine-core process, not in
    # a daemonic worker where the connector refuses to start (docs/vllm.md).
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3]), VLLM_ENABLE_V1_MULTIPROCESSING="0")
    return subprocess.Popen(args, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def _proxy(producer: str, consumer: str, *extra: str) -> tuple[subprocess.Popen[str], str]:
    p = subprocess.Popen([sys.executable, "-m", "kvproc", "proxy", "--producer", producer, "--consumer", consumer,
                          "--port", "0", *extra], stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline() if p.stdout else ""
    m = re.search(r"listening on (http://\S+)", line)
    assert m, f"kvproc proxy did not start: {line!r}"
    return p, m.group(1)


def _stop(p: subprocess.Popen[Any], timeout: float = 60) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


class Servers:
    def __init__(self, producer: str, consumer: str, procs: dict[str, subprocess.Popen[bytes]],
                 logs: dict[str, Path]) -> None:
        self.producer, self.consumer, self.procs, self.logs = producer, consumer, procs, logs
        self.t0 = time.monotonic()

    def wait_ready(self, deadline_s: float = 400) -> None:
        end = time.monotonic() + deadline_s
        for side, url in (("producer", self.producer), ("consumer", self.consumer)):
            while True:
                assert self.procs[side].poll() is None, f"{side} died:\n{self.logs[side].read_text()[-3000:]}"
                with contextlib.suppress(OSError):
                    if urllib.request.urlopen(url + "/health", timeout=5).status == 200:
                        break
                assert time.monotonic() < end, f"{side} not up in {deadline_s} s"
                time.sleep(0.5)


@pytest.fixture(scope="module")
def servers(tiny_llama: Path, shared_tier: str, run_tmpdir: Path) -> Iterator[Servers]:
    with serving(tiny_llama, shared_tier, run_tmpdir) as s:
        yield s


@contextlib.contextmanager
def serving(model: Path, tier: str, logdir: Path, model_args: Sequence[str] = LLAMA_ARGS) -> Iterator[Servers]:
    """A kv_producer and a kv_consumer `vllm serve` of `model` on one shared tier; stopped by SIGTERM at the end, and
    nothing of theirs may be left in /dev/shm."""
    ports = {"producer": _free_port(), "consumer": _free_port()}
    logs = {side: logdir / f"serve-{model.name}-{side}.log" for side in ports}
    procs = {side: _serve(model, f"kv_{side}", tier, port, logs[side], model_args) for side, port in ports.items()}
    try:
        yield Servers(*(f"http://127.0.0.1:{ports[s]}" for s in ("producer", "consumer")), procs, logs)
    finally:
        # The servers' engine-core processes (their children) own the connector's arenas: name them before they go.
        pids = [p.pid for p in procs.values()] + [c.pid for p in procs.values() if p.poll() is None
                                                  for c in psutil.Process(p.pid).children(recursive=True)]
        for p in procs.values():
            _stop(p)
        # vLLM's API server stops its engine core with SIGTERM and, at once (--shutdown-timeout 0), SIGKILL to its
        # whole tree: kvproc's janitor (outside that tree) sweeps what the engine and kvproc's processes leave.
        end = time.monotonic() + 90  # generous: a loaded machine; no timing is asserted
        while (left := _segments_of(pids)) and time.monotonic() < end:
            time.sleep(0.2)
        if left:
            sweep_dead_segments(pids=pids)  # not to leave them to the next run; the assertion below still fails
        assert not left, f"the servers left these in /dev/shm after SIGTERM: {left}"
        # And it was the janitor (any kvproc start on the machine sweeps dead owners too, so an empty /dev/shm alone
        # could be another test's doing): its line is in each server's log (its stdout is the engine's).
        for side, path in logs.items():
            assert "janitor_swept_after_launcher_death" in path.read_text(errors="replace"), f"{side}: no janitor"


def _segments_of(pids: list[int]) -> list[str]:
    """Segments and owner lock files of these processes (`kvproc.<cluster>.<role>.<pid>.<n|owner>`)."""
    return [n for n in os.listdir("/dev/shm") if n.startswith("kvproc.") and any(f".{pid}." in n for pid in pids)]


def _post(url: str, body: dict[str, Any], timeout: float = 120, path: str = "/v1/completions") -> tuple[int, Any]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            if body.get("stream"):
                events = [json.loads(line[5:]) for line in (raw.decode().strip() for raw in r)
                          if line.startswith("data:") and line != "data: [DONE]"]
                return r.status, events
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))


def _consumer_counts(url: str) -> tuple[float, float, float]:
    """(prompt tokens loaded from kvproc, prompt tokens computed, requests finished) so far."""
    return (_metric(url, "vllm:external_prefix_cache_hits_total"),
            _metric(url, "vllm:request_prefill_kv_computed_tokens_sum"),
            _metric(url, "vllm:request_prefill_kv_computed_tokens_count"))


def _body(prompt: list[int], **kw: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, **kw}


def test_proxy_gives_one_engines_tokens_streamed_or_not(reference: list[tuple[list[int], list[int]]],
                                                       servers: Servers) -> None:
    rng = random.Random(31)
    # Turns 1, 2 and 4 of three conversations: 112, 176 and 304 tokens, the last page partial.
    prompts, want = map(list, zip(*(reference[i] for i in (0, 5, 14))))
    servers.wait_ready()
    t_ready = time.monotonic()
    proxy, url = _proxy(servers.producer, servers.consumer)
    try:
        hits0, computed0, done0 = _consumer_counts(servers.consumer)
        # Non-streamed: the anchor and the consumer's tokens in one choice, usage of one engine.
        for p, w in zip(prompts[:2], want[:2]):
            status, out = _post(url, _body(p, return_token_ids=True))
            assert status == 200, out
            (ch,) = out["choices"]
            assert ch["token_ids"] == w
            assert ch["prompt_token_ids"] == p
            assert out["usage"]["prompt_tokens"] == len(p) and out["usage"]["completion_tokens"] == MAX_TOKENS
        # Streamed: the anchor first, then the consumer's chunks; the usage chunk patched.
        status, events = _post(url, _body(prompts[2], stream=True, return_token_ids=True,
                                          stream_options={"include_usage": True}))
        assert status == 200
        got = [t for ev in events for ch in ev.get("choices", []) for t in ch.get("token_ids") or []]
        assert got == want[2]
        assert events[0]["choices"][0]["prompt_token_ids"] == prompts[2]
        assert events[-1]["usage"]["prompt_tokens"] == len(prompts[2])
        assert events[-1]["usage"]["completion_tokens"] == MAX_TOKENS
        # The consumer computed no prompt token but the anchor of each request (the rest: the producer's hand-off,
        # from kvproc, or the shared system prompt already in vLLM's own cache).
        hits, computed, done = _consumer_counts(servers.consumer)
        assert done - done0 == len(prompts)
        assert computed - computed0 == len(prompts), "the consumer computed prompt tokens the producer had"
        assert hits - hits0 >= len(prompts[0])

        # Without return_token_ids the client sees no token-id fields (as from vLLM alone).
        status, out = _post(url, _body(prompts[0], max_tokens=3))
        assert status == 200 and "token_ids" not in out["choices"][0]
        # max_tokens=1: the producer's answer is the whole answer.
        status, out = _post(url, _body(prompts[1], max_tokens=1, return_token_ids=True))
        assert status == 200 and out["choices"][0]["token_ids"] == want[1][:1]

        # The producer's own refusal comes back as its status and message; the proxy's own refusals are 400s.
        status, out = _post(url, _body(random_tokens(rng, MAX_LEN + 10)))
        assert status == 400 and "producer answered 400" in out["error"]["message"], out
        status, out = _post(url, _body(prompts[0], n=2))
        assert status == 400 and "n/best_of" in out["error"]["message"]
    finally:
        _stop(proxy, 10)
    print(f"servers ready after {t_ready - servers.t0:.1f} s, requests {time.monotonic() - t_ready:.1f} s")


def _chat_body(messages: list[dict[str, str]], **kw: Any) -> dict[str, Any]:
    return {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, **kw}


def _conversation(rng: random.Random, system: int, user: int) -> list[dict[str, str]]:
    """Text the tiny tokenizer maps one word to one token (`tiny_llama.words`); the template adds its markers."""
    return [{"role": "system", "content": words([rng.randrange(FIRST_WORD, 500) for _ in range(system)])},
            {"role": "user", "content": words([rng.randrange(FIRST_WORD, 500) for _ in range(user)])}]


def test_proxy_chat_gives_one_engines_answer_streamed_or_not(servers: Servers) -> None:
    rng = random.Random(41)
    # Two conversations of ~110 and ~150 prompt tokens (template markers included), no page in common.
    convs = [_conversation(rng, 40, 64), _conversation(rng, 70, 75)]
    servers.wait_ready()
    # One engine's answers: the producer's own /v1/chat/completions, whole (the connector does not change tokens;
    # the consumer, whose computed-token count is checked below, never sees these requests).
    want = []
    for msgs in convs:
        status, ref = _post(servers.producer, _chat_body(msgs), path="/v1/chat/completions")
        assert status == 200, ref
        want.append(ref)
    proxy, url = _proxy(servers.producer, servers.consumer)
    try:
        hits0, computed0, done0 = _consumer_counts(servers.consumer)
        # Non-streamed: one chat.completion, the anchor's text first.
        status, out = _post(url, _chat_body(convs[0]), path="/v1/chat/completions")
        assert status == 200, out
        ref = want[0]
        assert out["object"] == "chat.completion"
        (ch,) = out["choices"]
        assert ch["message"]["role"] == "assistant"
        assert ch["message"]["content"] == ref["choices"][0]["message"]["content"]
        assert ch["token_ids"] == ref["choices"][0]["token_ids"] and len(ch["token_ids"]) == MAX_TOKENS
        assert out["prompt_token_ids"] == ref["prompt_token_ids"]
        assert ch["finish_reason"] == ref["choices"][0]["finish_reason"]
        assert out["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]
        assert out["usage"]["completion_tokens"] == ref["usage"]["completion_tokens"]
        # Streamed: chat.completion.chunk events, the role and the anchor's text first, usage of one engine.
        status, events = _post(url, _chat_body(convs[1], stream=True, stream_options={"include_usage": True}),
                               path="/v1/chat/completions")
        assert status == 200, events
        ref = want[1]
        assert all(ev["object"] == "chat.completion.chunk" for ev in events)
        first = events[0]["choices"][0]
        assert first["delta"]["role"] == "assistant"
        assert first["token_ids"] == ref["choices"][0]["token_ids"][:1]  # the anchor
        assert first["delta"]["content"] and ref["choices"][0]["message"]["content"].startswith(first["delta"]["content"])
        assert events[0]["prompt_token_ids"] == ref["prompt_token_ids"]
        deltas = [ch for ev in events for ch in ev["choices"]]
        assert "".join(ch["delta"].get("content") or "" for ch in deltas) == ref["choices"][0]["message"]["content"]
        assert [t for ch in deltas for t in ch.get("token_ids") or []] == ref["choices"][0]["token_ids"]
        assert [ch["finish_reason"] for ch in deltas if ch["finish_reason"]] == ["length"]
        assert events[-1]["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]
        assert events[-1]["usage"]["completion_tokens"] == MAX_TOKENS
        # The consumer computed only each request's anchor: the rendered prompt came from the producer's hand-off.
        hits, computed, done = _consumer_counts(servers.consumer)
        assert done - done0 == 2
        assert computed - computed0 == 2, "the consumer computed prompt tokens the producer had"
        assert hits - hits0 >= want[0]["usage"]["prompt_tokens"] - 1

        # max_tokens=1: the producer's answer is the whole answer, streamed or not.
        anchor = want[0]["choices"][0]["token_ids"][:1]
        status, out = _post(url, _chat_body(convs[0], max_tokens=1), path="/v1/chat/completions")
        assert status == 200 and out["choices"][0]["token_ids"] == anchor and out["usage"]["completion_tokens"] == 1
        assert out["kv_transfer_params"] is None
        status, events = _post(url, _chat_body(convs[0], max_tokens=1, stream=True), path="/v1/chat/completions")
        assert status == 200
        (ch,) = events[0]["choices"]
        assert ch["delta"]["role"] == "assistant" and ch["token_ids"] == anchor and ch["finish_reason"] == "length"

        # What the two-hop split cannot honour: a 400 naming the field.
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        for extra, field in (({"n": 2}, "n > 1"), ({"logprobs": True}, "logprobs"), ({"tools": tools}, "tools"),
                             ({"response_format": {"type": "json_object"}}, "response_format"),
                             ({"presence_penalty": 0.5}, "presence_penalty")):
            status, out = _post(url, _chat_body(convs[0], **extra), path="/v1/chat/completions")
            assert status == 400 and field in out["error"]["message"], (extra, out)
    finally:
        _stop(proxy, 10)


def test_proxy_a_dead_or_stuck_consumer_is_an_http_error_not_a_hang(servers: Servers) -> None:
    servers.wait_ready()
    prompt = random_tokens(random.Random(5), 40)
    dead = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    with socket.socket() as stuck:  # accepts connections (the kernel's backlog), never answers
        stuck.bind(("127.0.0.1", 0))
        stuck.listen(8)
        stuck_url = f"http://127.0.0.1:{stuck.getsockname()[1]}"
        for consumer, status_want, words in ((dead, 502, "consumer at"), (stuck_url, 504, "consumer")):
            proxy, url = _proxy(servers.producer, consumer, "--timeout-s", "3")
            try:
                for stream in (False, True):
                    t0 = time.monotonic()
                    status, out = _post(url, _body(prompt, stream=stream), timeout=60)
                    assert status == status_want, out
                    assert words in out["error"]["message"]
                    assert time.monotonic() - t0 < 60
            finally:
                _stop(proxy, 10)
    # A dead producer: the same, naming it.
    proxy, url = _proxy(dead, servers.consumer, "--timeout-s", "3")
    try:
        status, out = _post(url, _body(prompt), timeout=60)
        assert status == 502 and "producer at" in out["error"]["message"]
        health = urllib.request.Request(url + "/health")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(health, timeout=30)
        assert e.value.code == 503
    finally:
        _stop(proxy, 10)
