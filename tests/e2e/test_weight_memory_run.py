"""Whole runs with in-memory weight transfer (``weight_sync.transport: gloo``) on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_e2e import kill_mid_run
from tests.helpers.jobs import worker_log


@pytest.mark.timeout(900)
def test_gloo_transport_survives_a_killed_engine_and_serves_versions_in_memory(
    tmp_path: Path, tiny_model: Path
) -> None:
    """Every version a running engine loads comes over the gloo group, checked against the trainer's
    digests; SIGKILL of the generation worker mid-run costs nothing: the trainer's broadcast to it
    fails or never starts, its replacement starts from the disk copy, joins a new group and
    receives the following versions in memory again. Exactly-once and the staleness bound hold.
    The killed engine stalls at most one transfer to its replacement."""
    run_dir = tmp_path / "gloo"

    def loaded_in_memory(run_dir: Path) -> bool:  # the first engine took a version before it dies
        return any(r.get("via") == "gloo" for r in worker_log(run_dir, "generation", "weights loaded"))

    kill_mid_run(
        tmp_path,
        tiny_model,
        "gloo",
        "generation",
        total=16,
        batch=4,
        after=3,
        ready=loaded_in_memory,
        weight_sync__transport="gloo",
        weight_sync__transfer_timeout_s=10,
        bus__heartbeat_interval_s=1.0,  # the dead engine leaves groups 2 s after its last word
    )
    loads = [r for r in worker_log(run_dir, "generation", "weights loaded") if "via" in r]
    by_file: dict[str, list[str]] = {}
    for r in loads:
        by_file.setdefault(r["file"], []).append(r["via"])
    first, second = sorted(by_file, key=lambda f: (run_dir / "logs" / f).stat().st_mtime)
    assert by_file[first] and set(by_file[first]) == {"gloo"}, by_file
    assert "gloo" in by_file[second], f"the replacement engine never received in memory: {by_file}"
    # A group may hold the killed engine while it is still heard from lately (two heartbeat
    # intervals, 2 s here; the replacement takes over 3 s to start) if the replacement is back that
    # soon; that costs one timeout, never a second one for a later version offered to the same group.
    waits = [
        r
        for r in worker_log(run_dir, "generation", "in-memory weight transfer failed; loading the disk copy")
        if "timeout" in r["error"]
    ]
    assert len(waits) <= 1, f"the engine waited for a dead member more than once: {waits}"
    # Each completed broadcast reached the engine (the killed one may have died before logging it).
    sent = len(worker_log(run_dir, "trainer", "weights sent"))
    received = sum(r["via"] == "gloo" for r in loads)
    assert received <= sent <= received + 1, (sent, by_file)
    # The disk copy of every served version was still written (late joiners, checkpoints).
    final = run_dir / "weights" / "v16"
    assert (final / "manifest.json").is_file() and (final / "model.safetensors").stat().st_size > 0
