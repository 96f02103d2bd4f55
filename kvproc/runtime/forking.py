"""Forking children: the forkserver context and its preload list, and keeping the launcher's `__main__` out."""

from __future__ import annotations

import contextlib
import multiprocessing
import sys
from typing import Any, Iterator, Sequence

from kvproc.runtime.config import RoleConfig
from kvproc.runtime.roles import resolve_role_class


def forkserver_context(configs: Sequence[RoleConfig]) -> Any:
    ctx = multiprocessing.get_context("forkserver")
    modules = {c.class_path.partition(":")[0] for c in configs}
    needs_torch = any(resolve_role_class(c.class_path).needs_torch for c in configs)
    ctx.set_forkserver_preload(["kvproc.runtime.child", *sorted(modules), *(["torch"] if needs_torch else [])])
    return ctx


def own_mp_temp_dir() -> str | None:
    """The multiprocessing temp dir of this process (its forkserver's socket lives there), made now if there is none
    yet: then it is the launcher's own, returned so that its janitor can remove it should the launcher be SIGKILLed
    (multiprocessing removes it only at a clean exit). None: another user of multiprocessing in this process made it,
    and it is not ours to remove."""
    from multiprocessing import process, util

    if process.current_process()._config.get("tempdir") is not None:  # type: ignore[attr-defined]
        return None
    return str(util.get_temp_dir())


@contextlib.contextmanager
def parent_main_hidden() -> Iterator[None]:
    """Keep the forkserver from re-running the launcher's main script in each child.

    multiprocessing's spawn preparation would re-import `__main__` by path in the child (the "main guard" rule): an
    engine script without `if __name__ == "__main__"` would then start a second engine inside every child. Children
    never need it (their target lives in kvproc), so the main module's spec and file are hidden while `start()`
    builds the preparation data.
    """
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved: dict[str, Any] = {k: main.__dict__[k] for k in ("__spec__", "__file__") if k in main.__dict__}
    main.__dict__["__spec__"] = None
    main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)
