"""A base revision's compiled helpers and one of its modules, loaded beside the current ones: what the A/B scripts
here (`device_events_cost.py`, `device_event_log.py`) compare against in the same run."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sysconfig
import types

import kvproc.native


def _load(name: str, path: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def native_at(rev: str, tmp: str) -> types.ModuleType:
    """`rev`'s `kvproc.native._native`, built from its sources (every .c and .h it had) into `tmp`."""
    src = os.path.join(tmp, "src")
    os.makedirs(src)
    names = subprocess.check_output(["git", "ls-tree", "--name-only", rev, "kvproc/native/"], text=True).split()
    sources = [n for n in names if n.endswith((".c", ".h"))]
    for n in sources:
        with open(os.path.join(src, os.path.basename(n)), "wb") as out:
            out.write(subprocess.check_output(["git", "show", f"{rev}:{n}"]))
    so = os.path.join(tmp, "_native" + sysconfig.get_config_var("EXT_SUFFIX"))
    subprocess.check_call([os.environ.get("CC", "cc"), "-O3", "-shared", "-fPIC", "-I", sysconfig.get_paths()["include"],
                           *[os.path.join(src, os.path.basename(n)) for n in sources if n.endswith(".c")], "-o", so])
    return _load("kvproc_base_native._native", so)


def module_at(rev: str, path: str, tmp: str, native: types.ModuleType) -> types.ModuleType:
    """`rev`'s module at `path` (e.g. "kvproc/core/paged.py"), its `NATIVE` the base build `native`, also while it
    is imported (a module may bind what it takes from `NATIVE` at import)."""
    py = os.path.join(tmp, os.path.basename(path).replace(".py", "_base.py"))
    with open(py, "wb") as out:
        out.write(subprocess.check_output(["git", "show", f"{rev}:{path}"]))
    now = kvproc.native.NATIVE
    kvproc.native.NATIVE = native
    try:
        mod = _load("kvproc_base_" + os.path.basename(path)[:-3], py)
    finally:
        kvproc.native.NATIVE = now
    mod.NATIVE = native  # type: ignore[attr-defined]
    return mod
