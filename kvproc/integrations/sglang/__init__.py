"""kvproc as SGLang HiCache's storage tier (L3): `KvprocHiCacheStorage`, loaded by SGLang's `dynamic` backend.

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \
      '{"backend_name": "kvproc", "module_path": "kvproc.integrations.sglang", "class_name": "KvprocHiCacheStorage",
        "interface_v1": 1, "tier_runtime_dir": "/run/kvproc"}'

docs/sglang.md says what each option does and what was tested where. The backend class imports SGLang's storage base
class (and so torch) when it is first asked for (SGLang's loader does `getattr(module, class_name)`); the page-format
and key modules (`pages`, `keys`, `model`) import no SGLang, so that a vLLM engine storing pages in SGLang's format
(`kvproc.integrations.vllm.sglang_format`) can use them in an environment without SGLang. Nothing starts until SGLang
creates the backend.
"""

from typing import Any

from kvproc.integrations.sglang.errors import SglangBackendError, SglangConfigError, SglangInputError

__all__ = ["KvprocHiCacheStorage", "SglangBackendError", "SglangConfigError", "SglangInputError"]


def __getattr__(name: str) -> Any:
    if name == "KvprocHiCacheStorage":
        from kvproc.integrations.sglang.backend import KvprocHiCacheStorage

        return KvprocHiCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
