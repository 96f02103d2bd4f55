"""kvproc as SGLang HiCache's storage tier (L3): `KvprocHiCacheStorage`, loaded by SGLang's `dynamic` backend.

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \
      '{"backend_name": "kvproc", "module_path": "kvproc.integrations.sglang", "class_name": "KvprocHiCacheStorage",
        "interface_v1": 1, "tier_runtime_dir": "/run/kvproc"}'

docs/sglang.md says what each option does and what was tested where. Importing this package imports SGLang's
storage base class (and so torch); nothing starts until SGLang creates the backend.
"""

from kvproc.integrations.sglang.backend import KvprocHiCacheStorage
from kvproc.integrations.sglang.errors import SglangBackendError, SglangConfigError, SglangInputError

__all__ = ["KvprocHiCacheStorage", "SglangBackendError", "SglangConfigError", "SglangInputError"]
