"""The backend's settings: kvproc's keys in SGLang's `--hicache-storage-backend-extra-config` JSON.

SGLang hands the backend the whole extra config, its own keys included (the dynamic loader's three, `interface_v1`,
the prefetch knobs it has not popped). Those are let through; any other unknown key is refused by name, so a typo
fails the engine's start instead of silently running with a default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from kvproc.integrations.sglang.errors import SglangConfigError

# Keys SGLang itself reads from the same JSON (0.5.x): passed through, never ours to judge.
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1", "prefetch_threshold",
                         "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "tp_lcm_size",
                         "hicache_storage_pass_prefix_keys"})
_LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class BackendOptions:
    # A running shared tier (`kvproc up --runtime-dir DIR`): the backend attaches to it. None: the backend starts a
    # host tier of its own (`host_bytes`), which lives as long as the backend.
    tier_runtime_dir: str | None = None
    # The tier's budget. With tier_runtime_dir, what the first engine to attach plans the shared tier's layout for:
    # at most the tier's `--host-mib` (whose default, 1 GiB, is this one's); later engines take that layout.
    host_bytes: int = 1 << 30
    # The weights' identity, part of every key and of the tier's fingerprint. None: SGLang's model name (its
    # `--model-path` / served name), which names a checkpoint but not its revision: set this where two revisions
    # of one model may share a tier.
    model_id: str | None = None
    log_level: str = "warning"  # kvproc's own processes (the tier and copy worker this backend starts)
    interface_v1: bool = False  # SGLang's: the zero-copy batch_get_v1 / batch_set_v1 path is the one it calls

    def __post_init__(self) -> None:
        if self.tier_runtime_dir is not None and (not isinstance(self.tier_runtime_dir, str)
                                                  or not self.tier_runtime_dir):
            raise SglangConfigError(f"kvproc backend: tier_runtime_dir must be a non-empty path, got "
                                    f"{self.tier_runtime_dir!r}")
        if isinstance(self.host_bytes, bool) or not isinstance(self.host_bytes, int) or self.host_bytes <= 0:
            raise SglangConfigError(f"kvproc backend: host_bytes must be a positive int, got {self.host_bytes!r}")
        if self.model_id is not None and (not isinstance(self.model_id, str) or not self.model_id):
            raise SglangConfigError(f"kvproc backend: model_id must be a non-empty string, got {self.model_id!r}")
        if self.log_level not in _LOG_LEVELS:
            raise SglangConfigError(f"kvproc backend: log_level must be one of {_LOG_LEVELS}, got "
                                    f"{self.log_level!r}")

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> "BackendOptions":
        if extra is not None and not isinstance(extra, Mapping):
            raise SglangConfigError(f"kvproc backend: the extra config must be a JSON object, got "
                                    f"{type(extra).__name__}")
        extra = dict(extra or {})
        ours = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in extra if k not in ours and k not in SGLANG_KEYS)
        if unknown:
            raise SglangConfigError(f"kvproc backend: unknown key(s) {unknown} in the extra config; kvproc's: "
                                    f"{sorted(ours - {'interface_v1'})}")
        kw = {k: v for k, v in extra.items() if k in ours}
        if "interface_v1" in kw:
            kw["interface_v1"] = bool(kw["interface_v1"])  # SGLang reads it as a truthy int
        return cls(**kw)
