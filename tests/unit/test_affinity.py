"""AREAL_CPU_AFFINITY: per-role cores, per-role I/O thread cores, clear errors on bad entries."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from workers.runtime import AFFINITY_ENV, cpu_affinity, io_thread_affinity

SPEC = "generation=0;trainer=1-3,5;trainer.io=0"


def test_roles_and_io_threads_get_their_cores():
    assert cpu_affinity("generation", SPEC) == {0}
    assert cpu_affinity("trainer", SPEC) == {1, 2, 3, 5}
    assert cpu_affinity("trainer.io", SPEC) == {0}
    assert cpu_affinity("reward", SPEC) is None
    assert cpu_affinity("trainer", "") is None
    assert cpu_affinity("trainer", " ; trainer = 2 ;") == {2}


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("trainer", r"'trainer' is not NAME=CORES"),
        ("trainer=one", r"core 'one'.*0, 0,1 or 2-5"),
        ("trainer=3-1", r"empty or negative range '3-1'"),
        ("trainer=", r"core ''"),
    ],
)
def test_bad_entries_name_the_entry_and_the_fix(spec, match):
    with pytest.raises(ValueError, match=match) as info:
        cpu_affinity("trainer", spec)
    assert AFFINITY_ENV in str(info.value)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux thread affinity")
def test_io_thread_runs_on_its_cores_and_restores_them(monkeypatch):
    cores = sorted(os.sched_getaffinity(0))
    target = {cores[-1]}
    monkeypatch.setenv(AFFINITY_ENV, f"trainer.io={cores[-1]}")
    seen: dict[str, set[int]] = {}

    def body() -> None:
        seen["before"] = os.sched_getaffinity(0)
        with io_thread_affinity("trainer"):
            seen["inside"] = os.sched_getaffinity(0)
        seen["after"] = os.sched_getaffinity(0)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen["inside"] == target
    assert seen["after"] == seen["before"] == set(cores)
    # only that thread moved: the caller keeps its cores
    assert os.sched_getaffinity(0) == set(cores)


def test_io_thread_affinity_is_a_no_op_without_an_entry(monkeypatch):
    monkeypatch.setenv(AFFINITY_ENV, "trainer=0")
    before = os.sched_getaffinity(0)
    with io_thread_affinity("trainer"):
        assert os.sched_getaffinity(0) == before


def test_worker_with_bad_affinity_exits_2_and_says_which_entry(tmp_path):
    """Checked before the worker connects: no bus needed, no traceback."""
    config = tmp_path / "run.yaml"
    config.write_text(f"name: aff\ndir: {tmp_path / 'run'}\n")
    code = f"from workers import cli; raise SystemExit(cli.worker_main(['--role','reward','--config',{str(config)!r}]))"
    env = {**os.environ, AFFINITY_ENV: "reward=zero"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2, out.stderr
    logged = (
        out.stdout + out.stderr + "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("*.jsonl"))
    )
    assert "bad cpu affinity" in logged and "reward='zero'" in logged
    assert "Traceback" not in out.stderr


def test_cuda_devices_become_each_roles_visible_devices(monkeypatch):
    """AREAL_CUDA_DEVICES puts roles on their own GPUs: the launcher sets CUDA_VISIBLE_DEVICES."""
    from areal_async.errors import ConfigError
    from workers.launcher import _worker_env
    from workers.runtime import CUDA_DEVICES_ENV, cuda_devices

    spec = "generation=0;trainer=2-1"
    with pytest.raises(
        ValueError, match=r"AREAL_CUDA_DEVICES: trainer='2-1' has the empty or negative range"
    ):
        cuda_devices("trainer", spec)
    with pytest.raises(ValueError, match=r"device 'x'"):
        cuda_devices("trainer", "trainer=x")
    base = {CUDA_DEVICES_ENV: "generation=0;trainer=1-2"}
    assert _worker_env(base, "generation", None)["CUDA_VISIBLE_DEVICES"] == "0"
    assert _worker_env(base, "trainer", None)["CUDA_VISIBLE_DEVICES"] == "1,2"
    assert "CUDA_VISIBLE_DEVICES" not in _worker_env(base, "reward", None)  # not named: all devices
    # Under Slurm the allocation is CUDA_VISIBLE_DEVICES, and the indices count within it.
    slurm = {**base, "CUDA_VISIBLE_DEVICES": "4,6,7"}
    assert _worker_env(slurm, "generation", None)["CUDA_VISIBLE_DEVICES"] == "4"
    assert _worker_env(slurm, "trainer", None)["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert _worker_env(slurm, "reward", None)["CUDA_VISIBLE_DEVICES"] == "4,6,7"
    with pytest.raises(ConfigError, match=r"gives trainer device 2, but CUDA_VISIBLE_DEVICES='4,6' holds 2"):
        _worker_env({**base, "CUDA_VISIBLE_DEVICES": "4,6"}, "trainer", None)
