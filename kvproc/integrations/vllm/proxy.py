"""`kvproc proxy`: an OpenAI-compatible HTTP front for P/D between two running `vllm serve` engines with kvproc's
connector, a `kv_producer` (prefill) and a `kv_consumer` (decode) sharing one `kvproc up` tier (docs/vllm.md).

Each `/v1/completions` request (and `/v1/chat/completions`: `proxy_chat.py`) goes to the producer with
`max_tokens=1` (its output token is the *anchor*, its `kv_transfer_params` kvproc's hand-off envelope), then to the
consumer as the prompt's token ids followed by the anchor, with `max_tokens` one less and the envelope; the client gets one response (the anchor first), streamed or
not as it asked. Errors of either side come back as HTTP errors naming the side; every upstream call has a deadline
(a dead or stuck engine is a 502/504, never a hang).

Needs only aiohttp (in kvproc's own environment and in vLLM's): importing this module does not import vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import structlog
from aiohttp import web

from kvproc.integrations.vllm import proxy_chat as chat
from kvproc.integrations.vllm.proxy_common import (
    ProxyError,
    check_fields,
    consumer_params,
    merged_usage,
    refuse,
    send,
    split_refusals,
    start_sse,
)
from kvproc.integrations.vllm.proxy_common import upstream_message as _upstream_message

log = structlog.get_logger("kvproc.vllm.proxy")

# What the producer is asked for. kvproc's producer makes every request it finishes a hand-off; the flag is vLLM's
# own P/D convention (other connectors read it), harmless to kvproc's.
PREFILL_PARAMS = {"do_remote_decode": True}
# Request fields the two-hop split cannot honour: refused with a 400 naming them, never silently dropped.
UNSUPPORTED = ("echo", "logprobs", "prompt_logprobs", "suffix", "prompt_embeds")


@dataclass(frozen=True)
class ProxyOptions:
    producer: str  # base URL of the kv_producer `vllm serve`, e.g. http://127.0.0.1:8100
    consumer: str  # base URL of the kv_consumer `vllm serve`
    connect_timeout_s: float = 10.0
    # The longest a non-streamed upstream answer may take, and the longest gap between two chunks of a stream.
    timeout_s: float = 300.0


class PdProxy:
    def __init__(self, options: ProxyOptions) -> None:
        self.options = options
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the proxy's app is not started"
        return self._session

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_json_errors])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _: web.Application) -> None:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def _stop(self, _: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    def _url(self, side: str, path: str) -> str:
        base = self.options.producer if side == "producer" else self.options.consumer
        return base.rstrip("/") + path

    # ---- upstream calls: every one bounded, every failure a ProxyError naming the side ----

    async def _post_json(self, side: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        timeout = aiohttp.ClientTimeout(total=self.options.timeout_s, connect=self.options.connect_timeout_s)
        try:
            async with self.session.post(self._url(side, path), json=body, timeout=timeout) as r:
                text = await r.text()
                if r.status != 200:
                    raise ProxyError(r.status, _upstream_message(side, r.status, text), f"{side}_error")
                out = json.loads(text)
                if not isinstance(out, dict):
                    raise ValueError("not a JSON object")  # noqa: TRY004 - reported below as "not a completion"
                return out
        except asyncio.TimeoutError as e:
            raise ProxyError(504, f"{side} at {self._url(side, path)} did not answer within "
                                  f"{self.options.timeout_s:g} s", f"{side}_timeout") from e
        except aiohttp.ClientError as e:
            raise ProxyError(502, f"{side} at {self._url(side, path)} unreachable: {type(e).__name__}: {e}", f"{side}_unreachable") from e
        except ValueError as e:
            raise ProxyError(502, f"{side} answered with a body that is not a completion: {e}", f"{side}_error") from e

    async def _open_stream(self, side: str, path: str, body: dict[str, Any]) -> aiohttp.ClientResponse:
        """A streamed upstream response with a 200 status (the caller closes it); a failure before the first byte
        is a ProxyError, so the client still gets a proper HTTP error."""
        timeout = aiohttp.ClientTimeout(total=None, connect=self.options.connect_timeout_s,
                                        sock_read=self.options.timeout_s)
        try:
            r = await self.session.post(self._url(side, path), json=body, timeout=timeout)
        except asyncio.TimeoutError as e:
            raise ProxyError(504, f"{side} at {self._url(side, path)} did not answer within "
                                  f"{self.options.timeout_s:g} s", f"{side}_timeout") from e
        except aiohttp.ClientError as e:
            raise ProxyError(502, f"{side} at {self._url(side, path)} unreachable: {type(e).__name__}: {e}", f"{side}_unreachable") from e
        if r.status != 200:
            try:
                text = await r.text()
            except (asyncio.TimeoutError, aiohttp.ClientError):
                text = ""
            r.release()
            raise ProxyError(r.status, _upstream_message(side, r.status, text), f"{side}_error")
        return r

    async def _events(self, side: str, r: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
        """The JSON events of an upstream SSE stream until `[DONE]`; a stall or a cut is a ProxyError."""
        try:
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                yield json.loads(data)
        except asyncio.TimeoutError as e:
            raise ProxyError(504, f"{side} sent nothing for {self.options.timeout_s:g} s mid-stream",
                             f"{side}_timeout") from e
        except aiohttp.ClientError as e:
            raise ProxyError(502, f"{side} stream broken: {type(e).__name__}: {e}", f"{side}_unreachable") from e
        except ValueError as e:
            raise ProxyError(502, f"{side} sent an event that is not JSON: {e}", f"{side}_error") from e
        raise ProxyError(502, f"{side} closed its stream before [DONE]", f"{side}_error")

    # ---- endpoints ----

    async def completions(self, request: web.Request) -> web.StreamResponse:
        t0 = time.monotonic()
        try:
            body = await request.json()
        except ValueError:
            return ProxyError(400, "the request body is not JSON", "invalid_request_error").response()
        try:
            _check_request(body)
            prefill = await self._post_json("producer", "/v1/completions", _prefill_body(body))
        except ProxyError as e:
            log.warning("kvproc_proxy_failed", stage="prefill", status=e.status, error=e.message)
            return e.response()
        choice = prefill["choices"][0]
        max_tokens = int(body.get("max_tokens") or 16)
        if max_tokens <= 1 or choice.get("finish_reason") == "stop":  # the anchor is the whole answer
            return await self._reply_prefill_only(request, body, prefill)
        envelope = prefill.get("kv_transfer_params")
        if not envelope:  # the producer made no hand-off: the consumer computes the prompt itself (right tokens)
            log.warning("kvproc_proxy_no_handoff", producer_id=prefill.get("id"))
        try:
            decode = _decode_body(body, choice, envelope, max_tokens)
            if body.get("stream"):
                return await self._stream_decode(request, decode, lambda ev: _anchor_chunk(body, prefill, ev),
                                                 lambda ev: _fix_chunk(body, prefill, ev))
            out = await self._post_json("consumer", "/v1/completions", decode)
        except ProxyError as e:
            log.warning("kvproc_proxy_failed", stage="decode", status=e.status, error=e.message)
            return e.response()
        log.debug("kvproc_proxy_done", ms=round((time.monotonic() - t0) * 1e3, 1))
        return web.json_response(_merge(body, prefill, out))

    async def _reply_prefill_only(self, request: web.Request, body: dict[str, Any],
                                  prefill: dict[str, Any]) -> web.StreamResponse:
        out = _merge(body, prefill, None)
        if not body.get("stream"):
            return web.json_response(out)
        resp = await start_sse(request)
        ch = out["choices"][0]
        await send(resp, dict(out, object="text_completion", choices=[ch]))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """The chat template is rendered by the producer only; the consumer continues from its token ids
        (`proxy_chat.py`)."""
        try:
            body = await request.json()
        except ValueError:
            return ProxyError(400, "the request body is not JSON", "invalid_request_error").response()
        try:
            budget = chat.check_chat_request(body)
            prefill = await self._post_json("producer", "/v1/chat/completions",
                                            chat.chat_prefill_body(body, PREFILL_PARAMS))
            chat.anchor_of(prefill)  # a producer's answer without token ids is a 502 before anything is sent
        except ProxyError as e:
            log.warning("kvproc_proxy_failed", stage="chat_prefill", status=e.status, error=e.message)
            return e.response()
        if (budget is not None and budget <= 1) or prefill["choices"][0].get("finish_reason") == "stop":
            return await self._chat_prefill_only(request, body, prefill)
        envelope = prefill.get("kv_transfer_params")
        if not envelope:
            log.warning("kvproc_proxy_no_handoff", producer_id=prefill.get("id"))
        try:
            decode = chat.chat_decode_body(body, prefill, envelope, budget)
            if body.get("stream"):
                return await self._stream_decode(request, decode, lambda _: chat.first_chunk(body, prefill, False),
                                                 lambda ev: chat.chat_chunk(body, prefill, ev))
            out = await self._post_json("consumer", "/v1/completions", decode)
        except ProxyError as e:
            log.warning("kvproc_proxy_failed", stage="chat_decode", status=e.status, error=e.message)
            return e.response()
        return web.json_response(chat.merge_chat(body, prefill, out))

    async def _chat_prefill_only(self, request: web.Request, body: dict[str, Any],
                                 prefill: dict[str, Any]) -> web.StreamResponse:
        if not body.get("stream"):
            return web.json_response(chat.merge_chat(body, prefill, None))
        resp = await start_sse(request)
        await send(resp, chat.first_chunk(body, prefill, True))
        if (body.get("stream_options") or {}).get("include_usage"):
            await send(resp, chat.usage_chunk(prefill))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _stream_decode(self, request: web.Request, decode: dict[str, Any],
                             first: Callable[[dict[str, Any]], dict[str, Any]],
                             convert: Callable[[dict[str, Any]], dict[str, Any]]) -> web.StreamResponse:
        """Relays the consumer's stream: `first(its first event)` (the anchor) first, then `convert(each event)`."""
        r = await self._open_stream("consumer", "/v1/completions", decode)
        resp: web.StreamResponse | None = None
        try:
            async for ev in self._events("consumer", r):
                if resp is None:  # the anchor first
                    resp = await start_sse(request)
                    await send(resp, first(ev))
                await send(resp, convert(ev))
        except ProxyError as e:
            log.warning("kvproc_proxy_failed", stage="decode_stream", status=e.status, error=e.message)
            if resp is None:
                return e.response()
            # Headers are sent: the error goes in the stream, as vLLM itself reports one, then the end.
            await send(resp, {"error": {"message": e.message, "type": e.kind, "code": e.status}})
        finally:
            r.release()
        if resp is None:
            return ProxyError(502, "consumer streamed no event", "consumer_error").response()
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def models(self, _: web.Request) -> web.Response:
        try:
            return web.json_response(await self._get_json("consumer", "/v1/models"))
        except ProxyError as e:
            return e.response()

    async def health(self, _: web.Request) -> web.Response:
        bad: dict[str, str] = {}
        for side in ("producer", "consumer"):
            try:
                await self._get_json(side, "/health", body=False)
            except ProxyError as e:
                bad[side] = e.message
        if bad:
            return web.json_response({"status": "unhealthy", **bad}, status=503)
        return web.json_response({"status": "ok"})

    async def _get_json(self, side: str, path: str, body: bool = True) -> Any:
        timeout = aiohttp.ClientTimeout(total=min(self.options.timeout_s, 30.0), connect=self.options.connect_timeout_s)
        try:
            async with self.session.get(self._url(side, path), timeout=timeout) as r:
                text = await r.text()
                if r.status != 200:
                    raise ProxyError(r.status, _upstream_message(side, r.status, text), f"{side}_error")
                return json.loads(text) if body else None
        except asyncio.TimeoutError as e:
            raise ProxyError(504, f"{side} did not answer {path} in time", f"{side}_timeout") from e
        except aiohttp.ClientError as e:
            raise ProxyError(502, f"{side} at {self._url(side, path)} unreachable: {type(e).__name__}: {e}", f"{side}_unreachable") from e


@web.middleware
async def _json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Whatever a handler did not answer itself still gets vLLM's JSON error shape: an HTTP error (404, 405) with its
    status, a bug a 500 naming the exception (logged with its traceback), never aiohttp's plain-text page."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return ProxyError(e.status, e.reason, "invalid_request_error" if e.status < 500 else "proxy_error").response()
    except ConnectionError:
        raise  # the client went away (mid-stream): nobody to answer
    except Exception as e:  # noqa: BLE001 - answered, and logged for the operator
        log.exception("kvproc_proxy_internal_error", path=request.path)
        return ProxyError(500, f"kvproc proxy: internal error: {type(e).__name__}: {e}", "proxy_error").response()


# ---- the two-hop split and merge (pure functions of the JSON bodies) ----

def _check_request(body: Any) -> None:
    if not isinstance(body, dict):
        raise ProxyError(400, "the request body is not a JSON object", "invalid_request_error")
    check_fields(body)
    bad = [k for k in UNSUPPORTED if body.get(k) not in (None, False)]
    try:
        if int(body.get("n") or 1) != 1 or int(body.get("best_of") or 1) != 1:
            bad.append("n/best_of > 1")
        int(body.get("max_tokens") or 16)
    except (TypeError, ValueError) as e:
        raise ProxyError(400, f"kvproc proxy: n, best_of and max_tokens must be integers: {e}",
                         "invalid_request_error") from e
    prompt = body.get("prompt")
    one = (isinstance(prompt, str) and prompt != "") or (
        isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt))
    if not one and not (isinstance(prompt, list) and len(prompt) == 1):
        bad.append("prompt (one prompt: a string or a list of token ids)")
    refuse(bad + split_refusals(body))


def _prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    out = dict(body, max_tokens=1, stream=False, return_token_ids=True, kv_transfer_params=PREFILL_PARAMS)
    out.pop("stream_options", None)
    out.pop("max_completion_tokens", None)
    if "min_tokens" in out:
        out["min_tokens"] = min(int(out["min_tokens"] or 0), 1)
    return out


def _decode_body(body: dict[str, Any], choice: dict[str, Any], envelope: dict[str, Any] | None,
                 max_tokens: int) -> dict[str, Any]:
    """The consumer's request: the prompt's token ids (as the producer tokenised them) and the anchor, so that the
    consumer's hash chain is the producer's; it computes only the anchor and what follows."""
    anchor = list(choice.get("token_ids") or [])
    prompt = list(choice.get("prompt_token_ids") or [])
    if not prompt or len(anchor) != 1:
        raise ProxyError(502, "producer's answer lacks prompt_token_ids/token_ids (is it vLLM?)", "producer_error")
    out = dict(body, prompt=prompt + anchor, max_tokens=max_tokens - 1, return_token_ids=True)
    params = consumer_params(body, envelope)
    if params:
        out["kv_transfer_params"] = params
    else:
        out.pop("kv_transfer_params", None)
    out.pop("max_completion_tokens", None)
    if "min_tokens" in out:
        out["min_tokens"] = max(0, int(out["min_tokens"] or 0) - 1)
    return out


def _merge(body: dict[str, Any], prefill: dict[str, Any], decode: dict[str, Any] | None) -> dict[str, Any]:
    """One completion: the anchor then the consumer's output; usage as if one engine had served it."""
    p = prefill["choices"][0]
    out = dict(decode if decode is not None else prefill)
    ch = dict(out["choices"][0])
    if decode is not None:
        ch["text"] = p.get("text", "") + ch.get("text", "")
        ch["token_ids"] = list(p.get("token_ids") or []) + list(ch.get("token_ids") or [])
        ch["prompt_token_ids"] = p.get("prompt_token_ids")
        out["usage"] = merged_usage(prefill.get("usage"), decode.get("usage"))
    if not body.get("return_token_ids"):
        ch.pop("token_ids", None)
        ch.pop("prompt_token_ids", None)
    out["choices"] = [ch]
    out["kv_transfer_params"] = None
    return out


def _anchor_chunk(body: dict[str, Any], prefill: dict[str, Any], first: dict[str, Any]) -> dict[str, Any]:
    p = prefill["choices"][0]
    ch: dict[str, Any] = {"index": 0, "text": p.get("text", ""), "logprobs": None, "finish_reason": None}
    if body.get("return_token_ids"):
        ch.update(token_ids=list(p.get("token_ids") or []), prompt_token_ids=p.get("prompt_token_ids"))
    return {k: first[k] for k in ("id", "object", "created", "model") if k in first} | {"choices": [ch]}


def _fix_chunk(body: dict[str, Any], prefill: dict[str, Any], ev: dict[str, Any]) -> dict[str, Any]:
    """A consumer chunk as the client expects it: the prompt it sent (without the anchor), usage of one engine."""
    for ch in ev.get("choices") or []:
        if not body.get("return_token_ids"):
            ch.pop("token_ids", None)
        ch.pop("prompt_token_ids", None)  # the anchor chunk carried the client's prompt ids
    if ev.get("usage"):
        ev["usage"] = merged_usage(prefill.get("usage"), ev["usage"])
    return ev


# ---- `kvproc proxy` ----

async def serve(options: ProxyOptions, host: str, port: int, ready: asyncio.Event | None = None) -> None:
    """Serve until cancelled or SIGINT/SIGTERM; prints one line with the address once listening."""
    runner = web.AppRunner(PdProxy(options).app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0]
    print(f"kvproc proxy listening on http://{bound[0]}:{bound[1]} (producer {options.producer}, "
          f"consumer {options.consumer})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvproc proxy", description="OpenAI-compatible P/D front for a kv_producer "
                                     "and a kv_consumer `vllm serve` running kvproc's connector")
    parser.add_argument("--producer", required=True, help="base URL of the prefill engine, e.g. http://127.0.0.1:8100")
    parser.add_argument("--consumer", required=True, help="base URL of the decode engine")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: a free port (printed)")
    parser.add_argument("--timeout-s", type=float, default=300.0,
                        help="longest wait for a non-streamed upstream answer, and between two streamed chunks")
    parser.add_argument("--connect-timeout-s", type=float, default=10.0)
    args = parser.parse_args(argv)
    options = ProxyOptions(args.producer, args.consumer, args.connect_timeout_s, args.timeout_s)
    asyncio.run(serve(options, args.host, args.port))
    return 0


__all__ = ["PdProxy", "ProxyError", "ProxyOptions", "main", "serve"]
