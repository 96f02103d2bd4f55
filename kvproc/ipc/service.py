"""Handler registration: a service (a role) is a class whose methods are marked `@handles(RequestType, ...)`.

The registration is checked when the service is built -- every handled type must be a member of the wire union
`messages.RequestBody`, no type may have two handlers, and each handler must take `(msg, ctx)` with `msg`
annotated as (a union containing) the type it handles -- so a mismatch fails at boot, not at the first request.
"""

from __future__ import annotations

import inspect
import types
import typing
from typing import Any, Callable, TypeVar, get_args

from kvproc.ipc import messages as m
from kvproc.ipc.context import CallContext, Deferred

Handler = Callable[[Any, CallContext], Any]
F = TypeVar("F", bound=Callable[..., Any])

_ATTR = "_kvproc_handles"


def handles(*request_types: type[m.Request]) -> Callable[[F], F]:
    """Mark a method as the handler of these request types."""

    def mark(fn: F) -> F:
        setattr(fn, _ATTR, tuple(request_types))
        return fn

    return mark


class ServiceError(TypeError):
    """A service's handler table is inconsistent with the wire types (raised at construction)."""


def _accepts(annotation: Any, cls: type) -> bool:
    if annotation is inspect.Parameter.empty or annotation is Any:
        return True
    if isinstance(annotation, type):
        return issubclass(cls, annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_accepts(a, cls) for a in get_args(annotation))
    return False


class Service:
    """Base of anything an `RpcServer` serves. Subclasses add `@handles` methods."""

    #: request types answered on the socket thread: only handlers that never block (short dict work under a lock
    #: held briefly, or an immediate `ctx.defer()`); everything else runs on the handler pool.
    inline: frozenset[type[m.Request]] = frozenset()

    def handler_table(self) -> dict[type[m.Request], Handler]:
        known = set(get_args(m.RequestBody))
        table: dict[type[m.Request], Handler] = {}
        for name in dir(type(self)):
            fn = getattr(type(self), name, None)
            marked = getattr(fn, _ATTR, None)
            if not marked:
                continue
            bound = getattr(self, name)
            hints = typing.get_type_hints(fn, vars(__import__(fn.__module__, fromlist=["_"])))
            params = list(inspect.signature(bound).parameters.values())
            if len(params) != 2:
                raise ServiceError(f"{type(self).__name__}.{name} must take (msg, ctx), has {len(params)} params")
            for cls in marked:
                where = f"{type(self).__name__}.{name} handles {cls.__name__}"
                if cls not in known:
                    raise ServiceError(f"{where}, which is not in messages.RequestBody (add it to the union)")
                if cls in table:
                    raise ServiceError(f"{where}, already handled by {table[cls].__name__}")
                if not _accepts(hints.get(params[0].name, inspect.Parameter.empty), cls):
                    raise ServiceError(f"{where}, but its msg parameter is annotated {hints.get(params[0].name)}")
                table[cls] = bound
        return table

    def on_stop(self) -> None:
        """Called once on the socket thread's way out, before the server closes its sockets."""


__all__ = ["Service", "ServiceError", "handles", "Handler", "Deferred", "CallContext"]
