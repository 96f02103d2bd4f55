"""`LocalMooncake` (the loopback Mooncake Store of the tests and benchmarks) starts again from scratch when a start
fails, and a start that fails for good says why with each process's log tail (its temporary log folder is gone by
then). Real processes: a real Mooncake Store where the `remote` extra is installed, `/bin/sh` for a process that
dies."""

from __future__ import annotations

import tempfile

import pytest

from kvproc.tiers import mooncake_local
from kvproc.tiers.mooncake_local import LocalMooncake, unavailable_reason


def test_a_process_that_dies_before_it_listens_is_reported_with_its_logs_end() -> None:
    with tempfile.TemporaryDirectory(prefix="kvmcl-") as d:
        mc = LocalMooncake.__new__(LocalMooncake)  # no Mooncake needed for the helper itself
        mc.log_dir, mc._starts, mc._env, mc._log_of = d, 0, {}, {}
        proc = mc._spawn(["/bin/sh", "-c", "echo first; echo 'bind: address in use'; exit 3"], "storage")
        with pytest.raises(RuntimeError, match="exited with 3") as err:
            mc._wait(proc, mooncake_local.free_port(), "mooncake_client", 30.0)
    assert "bind: address in use" in str(err.value) and "first" in str(err.value)


def test_a_failed_start_is_retried_on_fresh_ports_and_a_second_failure_names_both(monkeypatch) -> None:
    why = unavailable_reason()
    if why:
        pytest.skip(why)
    real = LocalMooncake.start_storage
    calls: list[int] = []

    def storage_fails_once(self: LocalMooncake, timeout_s: float = 30.0) -> None:
        calls.append(self.node_port)
        if len(calls) == 1:  # what a storage node that never listens looks like to `start`
            raise TimeoutError(f"mooncake_client not listening on {self.node_port} after {timeout_s}s")
        real(self, timeout_s)

    monkeypatch.setattr(LocalMooncake, "start_storage", storage_fails_once)
    with LocalMooncake.start(segment_mb=16) as mc:
        assert mc.storage is not None and mc.storage.poll() is None and mooncake_local._listening(mc.node_port)
    assert len(calls) == 2 and calls[0] != calls[1]  # the second start had ports of its own

    def storage_always_fails(self: LocalMooncake, timeout_s: float = 30.0) -> None:
        raise TimeoutError(f"mooncake_client not listening on {self.node_port}")

    monkeypatch.setattr(LocalMooncake, "start_storage", storage_always_fails)
    with pytest.raises(TimeoutError, match="did not start") as err:
        LocalMooncake.start(segment_mb=16)
    assert "start 1: " in str(err.value) and "start 2: " in str(err.value)
