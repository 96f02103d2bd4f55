"""`kvproc check MODULE:FACTORY [--ranks N] [--seed S]`: build a model with `FACTORY()` and prove its KV contract
(`kvproc.check_model`). Prints which groups are cached (and why not), each proof, and every failure with its group,
arena and byte offset; exits 0 when every proof holds, 1 on any failure, 2 when the factory cannot be loaded."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any, Sequence


def load_factory(path: str) -> Any:
    """"package.module:function" (a dotted attribute after the colon is followed) -> the callable."""
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{path!r}: expected MODULE:FACTORY, e.g. kvproc.check.builtins:mla")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{path!r} is not callable")
    return obj


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvproc check", description=__doc__.split("\n\n")[0])
    p.add_argument("factory", help="MODULE:FACTORY, a callable of no arguments returning a fresh model")
    p.add_argument("--ranks", type=int, default=None, help="ranks to check at (default: the model's `ranks`, or 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random bytes")
    args = p.parse_args(argv)
    try:
        model = load_factory(args.factory)()
    except Exception as e:  # noqa: BLE001 - the integrator's import or constructor: say which, exit 2
        print(f"kvproc check: cannot build a model with {args.factory}: {e!r}", file=sys.stderr)
        return 2
    if not hasattr(model, "spec") or not hasattr(model, "arenas"):
        print(f"kvproc check: {args.factory}() returned {type(model).__name__}, which has no spec()/arenas() "
              "(kvproc.KvModel)", file=sys.stderr)
        return 2
    from kvproc.check.api import check_model

    report = check_model(model, ranks=args.ranks, seed=args.seed)
    print(report.text())
    return 0 if report.ok else 1
