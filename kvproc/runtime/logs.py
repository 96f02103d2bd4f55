"""Logging: structlog JSON lines, one per event, each carrying role, pid and rank.

Every process calls `configure_logging(role, rank)` at its entry (children in `child.py`, `kvproc up` in its main);
modules bind `log = structlog.get_logger(__name__)` once. The pid is read at log time so that a logger configured
before a fork still names the right process.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, MutableMapping, TextIO

import msgspec
import structlog

_json = msgspec.json.Encoder(enc_hook=repr)  # anything msgspec cannot encode is logged as its repr


def _serialize(obj: Any, **_: Any) -> str:
    return _json.encode(obj).decode()


def configure_logging(role: str, rank: int = 0, *, level: str = "info", stream: TextIO | None = None) -> None:
    def identity(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        event["role"] = role
        event["rank"] = rank
        event["pid"] = os.getpid()
        return event

    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            identity,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(serializer=_serialize),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.WriteLoggerFactory(file=stream or sys.stderr),
        cache_logger_on_first_use=False,  # a child reconfigures after fork; cached proxies would keep the old sink
    )
