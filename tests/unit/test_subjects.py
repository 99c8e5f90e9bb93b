"""Subject, stream, consumer and bucket names of a run (bus/subjects.py)."""

from __future__ import annotations

import pytest

from bus.subjects import Subjects, subject_suffix, validate_run_name


@pytest.mark.parametrize("run", ["r1", "gsm8k-qwen_0p5b", "A-Z_0-9"])
def test_valid_run_names_are_accepted(run: str) -> None:
    """Letters, digits, '_' and '-' make a run name."""
    assert validate_run_name(run) == run


@pytest.mark.parametrize("run", ["", "a.b", "a b", "a*", "a>", "ü", "r1\n"])
def test_invalid_run_names_are_refused_with_the_rule_and_a_fix(run: str) -> None:
    """A name that cannot be a subject token fails with the field, the rule and a fix."""
    with pytest.raises(ValueError, match=r"run name must match .*rename the run"):
        validate_run_name(run)
    with pytest.raises(ValueError, match="run name"):
        Subjects(run)


def test_every_subject_lives_under_the_run_prefix() -> None:
    """All subjects of run r1 start with areal.r1. and the all-run wildcard taps them."""
    s = Subjects("r1")
    expected = {
        "prompt": "areal.r1.prompt",
        "rollout_generated": "areal.r1.rollout.generated",
        "rollout_scored": "areal.r1.rollout.scored",
        "rollout_failed": "areal.r1.rollout.failed",
        "eval_scored": "areal.r1.eval.scored",
        "trainer_step": "areal.r1.trainer.step",
        "weights_published": "areal.r1.weights.published",
        "weights_load": "areal.r1.weights.load",
        "weights_loaded": "areal.r1.weights.loaded",
        "weights_served": "areal.r1.weights.served",
        "heartbeat_all": "areal.r1.heartbeat.>",
        "deadletter": "areal.r1.deadletter",
        "metrics": "areal.r1.metrics",
        "run_ended": "areal.r1.run.ended",
        "all": "areal.r1.>",
    }
    assert {k: getattr(s, k) for k in expected} == expected
    assert s.heartbeat("generation", "node1-42") == "areal.r1.heartbeat.generation.node1-42"


def test_heartbeat_tokens_are_validated() -> None:
    """A dot in a worker id would add a subject token, so it is refused naming the field."""
    with pytest.raises(ValueError, match="worker_id"):
        Subjects("r1").heartbeat("generation", "node1.local")
    with pytest.raises(ValueError, match="heartbeat role"):
        Subjects("r1").heartbeat("gen*", "w1")


def test_streams_have_the_specified_names_retention_and_consumers() -> None:
    """Seven streams named AREAL_<run>_<KEY>, work queues with one durable each."""
    s = Subjects("r1")
    got = {spec.key: (spec.name, spec.subject, spec.retention, spec.consumer) for spec in s.streams}
    assert got == {
        "PROMPT": ("AREAL_r1_PROMPT", "areal.r1.prompt", "work_queue", "generation"),
        "GENERATED": ("AREAL_r1_GENERATED", "areal.r1.rollout.generated", "work_queue", "reward"),
        "SCORED": ("AREAL_r1_SCORED", "areal.r1.rollout.scored", "work_queue", "trainer"),
        "EVAL": ("AREAL_r1_EVAL", "areal.r1.eval.scored", "work_queue", "controller-eval"),
        "FAILED": ("AREAL_r1_FAILED", "areal.r1.rollout.failed", "work_queue", "controller-failed"),
        "STEPS": ("AREAL_r1_STEPS", "areal.r1.trainer.step", "limits", "controller-steps"),
        "DEADLETTER": ("AREAL_r1_DEADLETTER", "areal.r1.deadletter", "limits", None),
    }


def test_a_stream_is_found_by_key_name_or_consumer() -> None:
    """consume() accepts 'PROMPT', 'AREAL_r1_PROMPT' or 'generation' for the same stream."""
    s = Subjects("r1")
    assert s.stream("PROMPT") is s.stream("AREAL_r1_PROMPT") is s.stream("generation")
    with pytest.raises(ValueError, match="unknown stream or consumer 'nope'.*PROMPT/generation"):
        s.stream("nope")


def test_core_subjects_have_no_stream() -> None:
    """weights.*, heartbeats, metrics and run.ended go through core NATS."""
    s = Subjects("r1")
    for subject in (
        s.weights_published,
        s.weights_load,
        s.weights_loaded,
        s.weights_served,
        s.metrics,
        s.run_ended,
    ):
        assert s.stream_for_subject(subject) is None
    assert s.stream_for_subject(s.heartbeat("reward", "w1")) is None
    assert s.stream_for_subject(s.rollout_scored).key == "SCORED"


def test_buckets_are_named_per_run() -> None:
    """KV buckets areal_<run>_state and areal_<run>_workers, addressable by short name."""
    s = Subjects("r1")
    assert (s.state_bucket, s.workers_bucket) == ("areal_r1_state", "areal_r1_workers")
    assert s.bucket("state") == s.bucket("areal_r1_state") == "areal_r1_state"
    assert s.bucket("workers") == "areal_r1_workers"
    with pytest.raises(ValueError, match="use 'state'"):
        s.bucket("areal_r2_state")


def test_suffix_strips_the_run_prefix() -> None:
    """The subject registry is keyed by the part after areal.<run>."""
    s = Subjects("r1")
    assert s.suffix("areal.r1.rollout.generated") == "rollout.generated"
    assert s.suffix("areal.r2.prompt") is None
    assert subject_suffix("areal.r2.heartbeat.a.b") == "heartbeat.a.b"
    assert subject_suffix("other.r1.prompt") is None
