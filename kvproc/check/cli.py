"""`kvproc check MODULE:FACTORY [--ranks N] [--seed S]`: build a model with `FACTORY()` and prove its KV contract
(`kvproc.check_model`). Prints which groups are cached (and why not), each proof, and every failure with its group,
arena and byte offset; exits 0 when every proof holds, 1 on any failure, 2 when the factory cannot be loaded.

`kvproc check --vllm MODEL_DIR [--dtype D] [--block-size N] [--max-model-len N]`: how kvproc's vLLM connector maps
that model's KV cache groups (`kvproc/check/vllm_mapping.py`), without serving; exits 0 when the connector takes the
model, 1 when it refuses it, 2 when vLLM cannot build it (or is not installed)."""

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
    p.add_argument("factory", nargs="?", help="MODULE:FACTORY, a callable of no arguments returning a fresh model")
    p.add_argument("--ranks", type=int, default=None, help="ranks to check at (default: the model's `ranks`, or 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random bytes")
    p.add_argument("--vllm", metavar="MODEL_DIR", default=None,
                   help="instead: how the vLLM connector maps this model's KV cache groups (its config.json; random "
                        "weights), without serving")
    p.add_argument("--dtype", default="auto", help="--vllm: vLLM's dtype")
    p.add_argument("--block-size", type=int, default=None, help="--vllm: vLLM's block size (default: vLLM's choice)")
    p.add_argument("--max-model-len", type=int, default=1024, help="--vllm: vLLM's max_model_len")
    args = p.parse_args(argv)
    if args.vllm is not None:
        return _check_vllm(args)
    if args.factory is None:
        p.error("give MODULE:FACTORY, or --vllm MODEL_DIR")
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


def _check_vllm(args: argparse.Namespace) -> int:
    try:
        import vllm  # noqa: F401 - only whether it is installed
    except ImportError:
        print("kvproc check --vllm: vLLM is not installed in this environment (make venv-vllm; then "
              ".venv-vllm/bin/python -m kvproc check --vllm MODEL_DIR)", file=sys.stderr)
        return 2
    from kvproc.check.vllm_mapping import vllm_mapping

    try:
        mapping = vllm_mapping(args.vllm, dtype=args.dtype, block_size=args.block_size,
                               max_model_len=args.max_model_len)
    except Exception as e:  # noqa: BLE001 - vLLM could not build the model (its config, its block size): say so, exit 2
        print(f"kvproc check --vllm: vLLM could not build {args.vllm}: {e!r}", file=sys.stderr)
        return 2
    print(mapping.text())
    return 0 if mapping.ok else 1
