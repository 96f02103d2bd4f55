"""`kvproc proxy`'s chat split as pure functions of the JSON bodies (no server: the servers' test is
`vllm/test_vllm_proxy.py`): what the consumer is sent, what the client gets back, and what is refused by name."""

from __future__ import annotations

from typing import Any

import pytest

from kvproc.integrations.vllm import proxy_chat as chat
from kvproc.integrations.vllm.proxy_common import ProxyError

MSGS = [{"role": "user", "content": "w7 w8"}]
# The producer's answer to a max_tokens=1 chat request with return_token_ids (vLLM's shape, trimmed).
PREFILL: dict[str, Any] = {
    "id": "chatcmpl-1", "object": "chat.completion", "created": 5, "model": "m", "prompt_token_ids": [4, 7, 8, 6, 5],
    "kv_transfer_params": {"kvproc_handoff": {"producer_req_id": "r"}},
    "choices": [{"index": 0, "message": {"role": "assistant", "content": " w9"}, "finish_reason": "length",
                 "token_ids": [9]}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}


def _refused(body: dict[str, Any]) -> str:
    with pytest.raises(ProxyError) as e:
        chat.check_chat_request(body)
    assert e.value.status == 400
    return e.value.message


def test_what_the_split_cannot_honour_is_refused_by_name() -> None:
    assert "n > 1" in _refused({"messages": MSGS, "n": 2})
    assert "top_logprobs" in _refused({"messages": MSGS, "top_logprobs": 3})
    assert "tools" in _refused({"messages": MSGS, "tools": [{"type": "function"}]})
    assert "messages[1].content" in _refused({"messages": [*MSGS, {"role": "user", "content": [
        {"type": "text", "text": "w7"}, {"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert "frequency_penalty" in _refused({"messages": MSGS, "frequency_penalty": 0.1})
    assert "structured_outputs" in _refused({"messages": MSGS, "structured_outputs": {"regex": "a"}})
    assert "messages" in _refused({"messages": []})
    # Accepted: tools the model may not call, text parts, a text response format; the budget is the client's.
    ok = {"messages": [{"role": "user", "content": [{"type": "text", "text": "w7"}]}], "tool_choice": "none",
          "tools": [{"type": "function"}], "response_format": {"type": "text"}, "max_completion_tokens": 9}
    assert chat.check_chat_request(ok) == 9
    assert chat.check_chat_request({"messages": MSGS}) is None  # none given: up to the context's end


def test_the_consumer_gets_the_rendered_ids_and_the_anchor_and_the_clients_sampling() -> None:
    body = {"messages": MSGS, "chat_template": "t", "tool_choice": "none", "temperature": 0.5, "seed": 3,
            "min_tokens": 4, "stop": ["w1"], "cache_salt": "s", "stream": True}
    env = PREFILL["kv_transfer_params"]
    out = chat.chat_decode_body(body, PREFILL, env, 16)
    assert out["prompt"] == [4, 7, 8, 6, 5, 9] and out["max_tokens"] == 15 and out["min_tokens"] == 3
    assert out["kv_transfer_params"] == env and out["return_token_ids"] is True
    assert {"messages", "chat_template", "tool_choice"}.isdisjoint(out)
    assert (out["temperature"], out["seed"], out["stop"], out["cache_salt"], out["stream"]) == (0.5, 3, ["w1"], "s",
                                                                                                True)
    assert chat.chat_decode_body({"messages": MSGS}, PREFILL, None, None)["max_tokens"] is None
    with pytest.raises(ProxyError) as e:  # not a vLLM answer: no ids to continue from
        chat.chat_decode_body(body, dict(PREFILL, prompt_token_ids=None), env, 16)
    assert e.value.status == 502


def test_the_client_gets_one_chat_completion_anchor_first() -> None:
    decode = {"choices": [{"index": 0, "text": " w10 w11", "token_ids": [10, 11], "finish_reason": "length",
                           "stop_reason": None}],
              "usage": {"prompt_tokens": 6, "completion_tokens": 2, "total_tokens": 8}}
    out = chat.merge_chat({"messages": MSGS, "return_token_ids": True}, PREFILL, decode)
    (ch,) = out["choices"]
    assert ch["message"] == {"role": "assistant", "content": " w9 w10 w11"} and ch["token_ids"] == [9, 10, 11]
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert out["id"] == "chatcmpl-1" and out["object"] == "chat.completion" and out["kv_transfer_params"] is None
    plain = chat.merge_chat({"messages": MSGS}, PREFILL, decode)
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain
    # Streamed: the role and the anchor first, then the consumer's chunks as chat chunks of the producer's id.
    first = chat.first_chunk({"return_token_ids": True}, PREFILL, False)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": " w9"}
    assert first["prompt_token_ids"] == [4, 7, 8, 6, 5] and first["choices"][0]["finish_reason"] is None
    ev = chat.chat_chunk({}, PREFILL, {"id": "cmpl-2", "choices": [{"text": " w10", "finish_reason": None}]})
    assert ev["id"] == "chatcmpl-1" and ev["object"] == "chat.completion.chunk"
    assert ev["choices"][0]["delta"] == {"content": " w10"} and "token_ids" not in ev["choices"][0]
    last = chat.chat_chunk({}, PREFILL, {"choices": [], "usage": decode["usage"]})
    assert last["choices"] == [] and last["usage"]["prompt_tokens"] == 5 and last["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("field, value, named", [
    ("max_tokens", -5, "max_tokens must be an integer >= 1"),
    ("max_tokens", 2.5, "max_tokens must be an integer >= 1"),
    ("max_tokens", "8", "max_tokens must be an integer >= 1"),
    ("max_tokens", True, "max_tokens must be an integer >= 1"),
    ("n", 0, "n must be an integer >= 1"),
    ("stream", "yes", "stream must be true or false"),
    ("kv_transfer_params", "x", "kv_transfer_params must be an object"),
    ("min_tokens", "x", "min_tokens must be an integer >= 0"),  # was an unhandled 500 (int("x") in the split)
])
def test_a_mistyped_field_is_a_400_naming_it_before_anything_goes_upstream(endpoint: str, field: str, value: Any,
                                                                           named: str) -> None:
    """Issue 39, item 5: `max_tokens: -5` was forwarded (and 2.5 or "8" coerced by `int()`); now every endpoint answers
    a 400 with a JSON error body, as vLLM's own server does."""
    import json

    from kvproc.integrations.vllm.proxy import _check_request  # noqa: PLC2701 - the completions endpoint's check

    body: dict[str, Any] = {"model": "m", field: value}
    body.update({"messages": MSGS} if endpoint == "chat" else {"prompt": "w7 w8"})
    with pytest.raises(ProxyError) as e:
        chat.check_chat_request(body) if endpoint == "chat" else _check_request(body)
    assert e.value.status == 400 and named in e.value.message
    resp = e.value.response()
    assert resp.status == 400 and named in json.loads(resp.text)["error"]["message"]


@pytest.mark.parametrize("body", [{"model": "m", "prompt": ""}, {"model": "m", "prompt": [1, True]},
                                  {"model": "m", "messages": [1]}, {"model": "m", "messages": [{"content": "x"}]},
                                  {"model": "m", "messages": [{"role": "user", "content": 5}]}])
def test_an_empty_prompt_or_a_message_without_a_role_is_a_400(body: dict[str, Any]) -> None:
    from kvproc.integrations.vllm.proxy import _check_request  # noqa: PLC2701

    with pytest.raises(ProxyError) as e:
        chat.check_chat_request(body) if "messages" in body else _check_request(body)
    assert e.value.status == 400


def test_control_well_typed_fields_pass() -> None:
    from kvproc.integrations.vllm.proxy import _check_request  # noqa: PLC2701

    _check_request({"model": "m", "prompt": [5, 6], "max_tokens": 8, "n": 1, "stream": True,
                    "max_completion_tokens": None})
    assert chat.check_chat_request({"model": "m", "messages": MSGS, "max_tokens": 3, "stream": False}) == 3


def test_an_unhandled_error_or_a_wrong_method_still_answers_a_json_error_body() -> None:
    """The proxy's middleware: a handler's bug is a JSON 500 naming it (not aiohttp's text page), a GET on a POST
    endpoint a JSON 405."""
    import asyncio
    import json

    from aiohttp.test_utils import TestClient, TestServer

    from kvproc.integrations.vllm.proxy import PdProxy, ProxyOptions

    async def run() -> tuple[int, Any, int, Any]:
        proxy = PdProxy(ProxyOptions("http://127.0.0.1:9", "http://127.0.0.1:9"))

        async def broken(_: Any) -> Any:
            raise KeyError("a bug")

        proxy.models = broken  # type: ignore[method-assign]
        async with TestClient(TestServer(proxy.app())) as client:
            r1 = await client.get("/v1/models")
            b1 = json.loads(await r1.text())
            r2 = await client.get("/v1/completions")
            b2 = json.loads(await r2.text())
            return r1.status, b1, r2.status, b2

    s1, b1, s2, b2 = asyncio.run(run())
    assert s1 == 500 and "KeyError" in b1["error"]["message"]
    assert s2 == 405 and b2["error"]["code"] == 405


@pytest.mark.parametrize("envelope", [{"kvproc_handoff": {"producer_req_id": "r"}}, None])
def test_the_clients_retention_hint_goes_to_the_consumer(envelope: dict[str, Any] | None) -> None:
    """The producer's request ends at the prompt: the consumer's saves carry the conversation on, so it is the one
    given the client's `kvproc_retain_s` (beside the envelope, or alone when the producer handed nothing off)."""
    from kvproc.integrations.vllm.proxy import _decode_body  # noqa: PLC2701 - the completions endpoint's

    hinted = {"kv_transfer_params": {"kvproc_retain_s": 600}}
    choice = {"token_ids": [9], "prompt_token_ids": [4, 7, 8]}
    for params in (chat.chat_decode_body({"messages": MSGS, **hinted}, PREFILL, envelope, 8)["kv_transfer_params"],
                   _decode_body({"prompt": "w7", **hinted}, choice, envelope, 8)["kv_transfer_params"]):
        assert params == {**(envelope or {}), "kvproc_retain_s": 600}
    # Control: no hint, and the consumer is given the envelope alone (or no kv_transfer_params at all)
    plain = chat.chat_decode_body({"messages": MSGS}, PREFILL, envelope, 8)
    assert plain.get("kv_transfer_params") == envelope
