"""An inert stand-in for torchvision, installed into `.venv-sglang` only (the Makefile copies it there).

PyPI's torchvision wheels are CUDA builds that fail to load against the CPU torch of that environment, and SGLang
imports torchvision only from its multimodal helpers, which its configs package pulls in at import time. The KV cache
code under test never calls them. Any name resolves to an object whose use fails loudly, so a test that reached real
image code would fail rather than pass on a fake. Never installed anywhere an engine runs: a GPU machine has the real
package."""

from typing import Any

# Read by transformers' version checks at import time: older than any real release, so no fast path picks it.
__version__ = "0.0.0"


class _Inert:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> "_Inert":
        return _Inert(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name}: the torchvision stand-in of kvproc's .venv-sglang has no image code")


def __getattr__(attr: str) -> _Inert:
    return _Inert(f"torchvision.{attr}")
