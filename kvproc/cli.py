"""`kvproc` command line: one dispatcher, each subcommand lives in the module that does its job.

Subcommands are imported lazily so that `kvproc console status` does not pay for importing torch.
"""

from __future__ import annotations

import importlib
import sys
from typing import Callable, Sequence

# subcommand -> (module, function taking argv, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "demo": ("kvproc.demo.single", "main", "run the reference engine demo (the main job)"),
    "check": ("kvproc.check.cli", "main", "prove a model's KV contract: kvproc check MODULE:FACTORY"),
    "bench": ("kvproc.bench.cli", "main", "benchmarks: replay, copy, ipc, hash"),
    "console": ("kvproc.runtime.console", "main", "inspect a running cluster: status, profile"),
    "up": ("kvproc.runtime.standalone", "up_main", "start a standalone host tier shared by engines on this node"),
    "down": ("kvproc.runtime.standalone", "down_main", "orderly shutdown of a cluster found through its manifest"),
    "proxy": ("kvproc.integrations.vllm.proxy", "main", "OpenAI-compatible P/D front for two `vllm serve` engines"),
}


def _usage() -> str:
    lines = ["usage: kvproc COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"kvproc: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    entry: Callable[[list[str]], int | None] = getattr(importlib.import_module(module), func)
    return int(entry(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
