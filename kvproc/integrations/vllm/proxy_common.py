"""What both of `kvproc proxy`'s endpoints share: its HTTP error, the usage of one engine, and the request fields
that the two-hop split (producer: the anchor; consumer: the rest) cannot honour."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web


class ProxyError(Exception):
    """One HTTP error to the client: its status and a message naming the side that failed."""

    def __init__(self, status: int, message: str, kind: str = "proxy_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind

    def response(self) -> web.Response:
        return web.json_response({"error": {"message": self.message, "type": self.kind, "code": self.status}},
                                 status=self.status)


def upstream_message(side: str, status: int, text: str) -> str:
    try:
        err = json.loads(text).get("error", text)
        msg = err.get("message", err) if isinstance(err, dict) else err
    except (ValueError, AttributeError):
        msg = text
    return f"{side} answered {status}: {str(msg)[:2000]}"


def merged_usage(prefill: dict[str, Any] | None, decode: dict[str, Any] | None) -> dict[str, Any] | None:
    """Usage as one engine counts it: the client's prompt once, every generated token (the anchor included)."""
    if not prefill or not decode:
        return decode
    prompt = int(prefill.get("prompt_tokens") or 0)
    completion = int(decode.get("completion_tokens") or 0) + int(prefill.get("completion_tokens") or 0)
    return dict(decode, prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def split_refusals(body: dict[str, Any]) -> list[str]:
    """Sampling that the consumer, which sees the anchor as a prompt token, would do differently from one engine:
    - presence/frequency penalties count generated tokens only (the anchor would escape them);
    - guided decoding (a `response_format` other than text, `structured_outputs`) would restart its grammar after
      the anchor."""
    bad = [k for k in ("presence_penalty", "frequency_penalty") if body.get(k) not in (None, 0, 0.0)]
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") in (None, "text")):
        bad.append("response_format (guided decoding)")
    if body.get("structured_outputs") is not None:
        bad.append("structured_outputs")
    return bad


def check_fields(body: dict[str, Any]) -> None:
    """The typed fields both endpoints read, checked as vLLM's own server checks them, before anything goes upstream:
    a 400 naming the field, never a value coerced on the way (`int("5")`, `int(2.5)`) nor one only an upstream
    refuses (a 502 for the client's mistake)."""
    for key in ("max_tokens", "max_completion_tokens", "n", "best_of"):
        v = body.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ProxyError(400, f"kvproc proxy: {key} must be an integer >= 1, got {v!r}", "invalid_request_error")
    v = body.get("min_tokens")
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
        raise ProxyError(400, f"kvproc proxy: min_tokens must be an integer >= 0, got {v!r}", "invalid_request_error")
    for key in ("stream", "echo"):
        v = body.get(key)
        if v is not None and not isinstance(v, bool):
            raise ProxyError(400, f"kvproc proxy: {key} must be true or false, got {v!r}", "invalid_request_error")
    for key in ("kv_transfer_params", "stream_options"):
        v = body.get(key)
        if v is not None and not isinstance(v, dict):
            raise ProxyError(400, f"kvproc proxy: {key} must be an object, got {v!r}", "invalid_request_error")


# The retention hint's key in a request's kv_transfer_params (the connector's `RETAIN_KEY`; docs/vllm.md, "Retention
# hint"): "this conversation comes back within about R s".
RETAIN_KEY = "kvproc_retain_s"


def consumer_params(body: dict[str, Any], envelope: dict[str, Any] | None) -> dict[str, Any] | None:
    """The consumer request's kv_transfer_params: the producer's envelope, and the client's retention hint (the
    producer's request ends at the prompt, so the consumer's saves are the ones to rank by it). None: neither."""
    hint = (body.get("kv_transfer_params") or {}).get(RETAIN_KEY)
    if hint is None:
        return envelope or None
    return {**(envelope or {}), RETAIN_KEY: hint}


def refuse(bad: list[str]) -> None:
    if bad:
        raise ProxyError(400, f"kvproc proxy: not supported in P/D: {', '.join(bad)}", "invalid_request_error")


async def start_sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


async def send(resp: web.StreamResponse, ev: dict[str, Any]) -> None:
    await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
