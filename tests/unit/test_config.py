"""Run-file loading: defaults, overrides, presets and the errors users see."""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog

from areal_async.config import RunConfig
from areal_async.errors import ConfigError
from areal_async.run_file import build_config, load_config, parse_override, write_resolved_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_every_shipped_config_loads() -> None:
    """Each YAML file under configs/ is a valid run file."""
    files = sorted(CONFIGS.glob("*.yaml"))
    assert files, "configs/ holds no run files"
    for path in files:
        assert isinstance(load_config(path), RunConfig), path


def test_defaults_without_a_file_are_valid() -> None:
    """load_config() with no file gives the documented defaults."""
    cfg = load_config()
    assert cfg.rollout.max_staleness == 2
    assert cfg.trainer.loss.preset == "ppo_decoupled"
    assert cfg.max_inflight == (2 + 1) * cfg.trainer.batch_size


def test_overrides_replace_nested_values_and_parse_yaml_scalars(tmp_path: Path) -> None:
    """--set a.b=c reaches nested sections; numbers, lists and null are parsed."""
    path = _write(tmp_path, "rollout:\n  group_size: 4\n")
    cfg = load_config(
        path,
        [
            "rollout.group_size=6",
            "rollout.sampling.max_new_tokens=32",
            "trainer.optimizer.betas=[0.8, 0.95]",
            "rollout.max_inflight=null",
            "name=abc",
        ],
    )
    assert cfg.rollout.group_size == 6
    assert cfg.rollout.sampling.max_new_tokens == 32
    assert cfg.trainer.optimizer.betas == [0.8, 0.95]
    assert cfg.rollout.max_inflight is None
    assert cfg.name == "abc"


def test_exponent_numbers_without_a_dot_are_numbers_in_files_and_overrides(tmp_path: Path) -> None:
    """`lr: 2e-5` is a float (YAML 1.2), in a run file and in --set, not the string PyYAML makes of it."""
    path = _write(tmp_path, "trainer:\n  optimizer:\n    lr: 3e-5\n")
    assert load_config(path).trainer.optimizer.lr == pytest.approx(3e-5)
    cfg = load_config(path, ["trainer.optimizer.lr=2e-5", "trainer.optimizer.eps=1E-8"])
    assert cfg.trainer.optimizer.lr == pytest.approx(2e-5)
    assert cfg.trainer.optimizer.eps == pytest.approx(1e-8)
    assert parse_override("name=2e") == (["name"], "2e")  # not a number: stays a string


def test_unknown_key_names_file_section_and_suggests_the_right_key(tmp_path: Path) -> None:
    """A typo is refused with the file, the section and a did-you-mean hint."""
    path = _write(tmp_path, "rollout:\n  group_sise: 8\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}:rollout: unknown key 'group_sise'; did you mean 'group_size'?"


def test_unknown_top_level_key_lists_valid_keys_when_nothing_is_close(tmp_path: Path) -> None:
    """With no close match the error lists what is valid."""
    path = _write(tmp_path, "zzzz: 1\n")
    with pytest.raises(ConfigError, match=r"unknown key 'zzzz'; valid keys: name, dir, seed, bus"):
        load_config(path)


def test_wrong_type_names_key_path_and_value(tmp_path: Path) -> None:
    """A string where an integer belongs names the key path and the value."""
    path = _write(tmp_path, "trainer:\n  batch_size: four\n")
    with pytest.raises(ConfigError, match=r"run.yaml:trainer.batch_size: expected an integer, got 'four'"):
        load_config(path)


def test_out_of_range_value_explains_the_rule(tmp_path: Path) -> None:
    """Validation in __post_init__ surfaces with the section and the reason."""
    path = _write(tmp_path, "rollout:\n  group_size: 1\n")
    with pytest.raises(ConfigError, match=r"rollout: group_size must be >= 2 for group advantages, got 1"):
        load_config(path)


def test_gpu_engine_switches_need_their_prerequisites() -> None:
    """cuda_graphs needs a CUDA device and compile needs cuda_graphs; each error names the fix."""
    with pytest.raises(ConfigError, match=r"cuda_graphs=true needs a CUDA device, got device='cpu'"):
        load_config(None, ["rollout.cuda_graphs=true"])
    with pytest.raises(
        ConfigError, match=r"compile=true .* needs cuda_graphs=true; set rollout.cuda_graphs=true"
    ):
        load_config(None, ["rollout.device=cuda", "rollout.compile=true"])
    cfg = load_config(None, ["rollout.device=cuda:1", "rollout.cuda_graphs=true", "rollout.compile=true"])
    assert cfg.rollout.cuda_graphs and cfg.rollout.compile


def test_kv_after_load_is_checked_against_the_engine() -> None:
    """keep and finish are local-engine modes; a typo or a remote engine gets an error naming the fix."""
    assert load_config(None, []).rollout.kv_after_load == "recompute"
    assert load_config(None, ["rollout.kv_after_load=keep"]).rollout.kv_after_load == "keep"
    assert load_config(None, ["rollout.kv_after_load=finish"]).rollout.kv_after_load == "finish"
    with pytest.raises(ConfigError, match=r"kv_after_load.*'recompute'.*'keep'.*'finish'"):
        load_config(None, ["rollout.kv_after_load=kept"])
    for engine in ("vllm", "sglang"):
        for mode in ("keep", "finish"):
            with pytest.raises(
                ConfigError,
                match=rf"kv_after_load={mode} is implemented by the local engine only, got engine='{engine}'; "
                r"set rollout.kv_after_load=recompute or rollout.engine=local",
            ):
                load_config(
                    None,
                    [
                        f"rollout.engine={engine}",
                        "rollout.server_urls=[http://h:8000]",
                        f"rollout.kv_after_load={mode}",
                    ],
                )


@pytest.mark.parametrize("key", ["logprob_kernel", "attention_kernel"])
def test_triton_kernels_need_a_cuda_trainer(key: str) -> None:
    """auto is the default; triton on a CPU trainer is refused with the keys to change."""
    assert getattr(load_config(None, []).trainer, key) == "auto"
    cfg = load_config(None, ["trainer.device=cuda", f"trainer.{key}=triton"])
    assert getattr(cfg.trainer, key) == "triton"
    with pytest.raises(ConfigError, match=rf"{key}=triton runs only on CUDA.*trainer.{key}=auto"):
        load_config(None, [f"trainer.{key}=triton"])
    with pytest.raises(ConfigError, match=rf"{key}: 'fast' is not one of"):
        load_config(None, [f"trainer.{key}=fast"])


def test_weights_root_defaults_to_the_run_dir_and_takes_the_run_name() -> None:
    """weight_sync.dir moves the published versions (e.g. to a tmpfs); a bad placeholder names the fix."""
    cfg = load_config(None, ["name=r1", "dir=/tmp/runs/{name}"])
    assert cfg.weights_root == Path("/tmp/runs/r1/weights")
    cfg = load_config(None, ["name=r1", "weight_sync.dir=/dev/shm/areal-{name}"])
    assert cfg.weights_root == Path("/dev/shm/areal-r1")
    with pytest.raises(
        ConfigError, match=r"weight_sync: dir '/dev/shm/\{run\}' has a placeholder other than \{name\}"
    ):
        load_config(None, ["weight_sync.dir=/dev/shm/{run}"])
    with pytest.raises(ConfigError, match=r"dir must be a path or null"):
        load_config(None, ["weight_sync.dir=' '"])


def test_literal_choice_suggests_the_closest_option(tmp_path: Path) -> None:
    """An invalid enum value lists the choices and the closest one."""
    path = _write(tmp_path, "trainer:\n  loss:\n    behave_cap_mode: clmp\n")
    with pytest.raises(ConfigError, match=r"'clmp' is not one of 'mask', 'clamp'; did you mean 'clamp'\?"):
        load_config(path)


def test_override_without_equals_is_refused() -> None:
    """--set needs KEY=VALUE."""
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        parse_override("rollout.group_size")


def test_missing_file_says_so(tmp_path: Path) -> None:
    """A path that does not exist is a clear error, not a traceback."""
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.yaml")


def test_run_name_must_be_a_subject_token(tmp_path: Path) -> None:
    """Dots or spaces in the run name would break subjects; they are refused."""
    with pytest.raises(ConfigError, match="may only hold letters, digits"):
        load_config(None, ["name=my.run"])


def test_loss_preset_applies_before_explicit_keys(tmp_path: Path) -> None:
    """A preset sets its recipe; keys in the file still win."""
    path = _write(tmp_path, "trainer:\n  loss:\n    preset: dapo\n    eps_clip_high: 0.3\n")
    cfg = load_config(path)
    assert cfg.trainer.loss.preset == "dapo"
    assert cfg.trainer.loss.dynamic_sampling is True
    assert cfg.trainer.loss.eps_clip_high == 0.3
    rloo = load_config(None, ["trainer.loss.preset=rloo"])
    assert rloo.trainer.loss.group_baseline == "loo"


def test_unknown_preset_suggests_a_known_one() -> None:
    """A misspelt preset is refused with a hint."""
    with pytest.raises(ConfigError, match=r"unknown preset 'grpoo'; did you mean 'grpo'\?"):
        load_config(None, ["trainer.loss.preset=grpoo"])


def test_the_megatron_context_parallel_key_of_older_run_files_is_read_as_the_one_key(tmp_path: Path) -> None:
    """``trainer.megatron.context_parallel`` (in a file or a ``--set``) is ``trainer.context_parallel``,
    with a warning naming the key to write instead; the file's other megatron keys stay."""
    text = "trainer:\n  backend: megatron\n  num_ranks: 4\n  megatron:\n    tensor_parallel: 2\n"
    path = _write(tmp_path, text + "    context_parallel: 2\n")
    with structlog.testing.capture_logs() as logs:
        cfg = load_config(path)
    assert cfg.trainer.context_parallel == 2 and cfg.trainer.megatron.tensor_parallel == 2
    (warning,) = [e for e in logs if e["log_level"] == "warning"]
    assert (
        warning["key"] == "trainer.megatron.context_parallel"
        and "trainer.context_parallel: 2" in warning["fix"]
    )
    assert load_config(None, ["trainer.backend=megatron", "trainer.megatron.context_parallel=2"]) == (
        load_config(None, ["trainer.backend=megatron", "trainer.context_parallel=2"])
    )


def test_the_old_and_the_new_context_parallel_key_must_agree(tmp_path: Path) -> None:
    """Both keys with different values is ambiguous: refused, naming both keys, their values and the fix."""
    path = _write(
        tmp_path,
        "trainer:\n  backend: megatron\n  context_parallel: 4\n  megatron:\n    context_parallel: 2\n",
    )
    with pytest.raises(
        ConfigError,
        match=r"trainer.megatron.context_parallel=2 and trainer.context_parallel=4 disagree.*"
        r"delete trainer.megatron.context_parallel",
    ):
        load_config(path)


def test_trackers_default_to_tensorboard_and_take_a_list_of_known_names() -> None:
    """``metrics.loggers`` is TensorBoard alone by default and takes any list of the three trackers."""
    assert load_config(None).metrics.loggers == ["tensorboard"]
    cfg = load_config(None, ["metrics.loggers=[tensorboard, wandb, mlflow]", "metrics.wandb.mode=offline"])
    assert cfg.metrics.loggers == ["tensorboard", "wandb", "mlflow"] and cfg.metrics.wandb.mode == "offline"
    assert load_config(None, ["metrics.loggers=[]"]).metrics.loggers == []


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("metrics.loggers=[tensorboard, wandbb]", r"unknown logger 'wandbb'; did you mean 'wandb'\?"),
        ("metrics.loggers=[mlflow, mlflow]", r"mlflow named more than once"),
        ("metrics.loggers=wandb", r"metrics.loggers: expected a list, got 'wandb'"),
        ("metrics.wandb.mode=ofline", r"'ofline' is not one of .*did you mean 'offline'\?"),
        ("metrics.rollout_every=0", r"rollout_every must be > 0"),
    ],
)
def test_tracker_settings_are_checked_with_the_fix(override: str, message: str) -> None:
    """An unknown or repeated logger, a single name instead of a list, a misspelt W&B mode and a
    zero table interval are refused at load, naming the key."""
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_the_tensorboard_switch_of_older_run_files_is_read_as_metrics_loggers(tmp_path: Path) -> None:
    """``logging.tensorboard: false`` is ``metrics.loggers`` without tensorboard (with a warning naming
    the new key); ``true`` keeps it; a file whose two keys disagree is refused."""
    with structlog.testing.capture_logs() as logs:
        cfg = load_config(_write(tmp_path, "logging:\n  tensorboard: false\n  format: json\n"))
    assert cfg.metrics.loggers == [] and cfg.logging.format == "json"
    (warning,) = [e for e in logs if e["log_level"] == "warning"]
    assert warning["key"] == "logging.tensorboard" and "metrics.loggers: []" in warning["fix"]
    assert load_config(None, ["logging.tensorboard=true"]).metrics.loggers == ["tensorboard"]
    same = load_config(None, ["logging.tensorboard=true", "metrics.loggers=[tensorboard, mlflow]"])
    assert same.metrics.loggers == ["tensorboard", "mlflow"]
    with pytest.raises(ConfigError, match=r"logging.tensorboard=False and metrics.loggers=.* disagree"):
        load_config(None, ["logging.tensorboard=false", "metrics.loggers=[tensorboard]"])


def test_resolved_config_is_written_and_reloads_identically(tmp_path: Path) -> None:
    """Each worker writes the resolved config; reading it back gives the same tree."""
    cfg = load_config(None, [f"dir={tmp_path}/{{name}}", "rollout.group_size=5"])
    path = write_resolved_config(cfg, "trainer")
    assert path == tmp_path / "demo" / "config" / "trainer.yaml"
    assert load_config(path) == cfg


def test_max_inflight_below_batch_size_is_refused() -> None:
    """A cap that can never fill one batch would deadlock the run; it is refused up front."""
    with pytest.raises(ConfigError, match=r"max_inflight \(2\) is below trainer.batch_size \(4\)"):
        load_config(None, ["rollout.max_inflight=2", "trainer.batch_size=4"])


def test_agent_settings_are_checked_and_pick_the_roles_of_a_run() -> None:
    """A workflow is a built-in or an import path; unknown tools are named; agent runs start the agent
    role instead of the reward role (agents score their own episodes)."""
    from workers.roles import run_roles

    with pytest.raises(ConfigError, match="workflow 'multi'"):
        build_config({"name": "r", "rollout": {"workflow": "multi"}})
    with pytest.raises(ConfigError, match="unknown tool"):
        build_config({"name": "r", "agent": {"tools": ["shell"]}})
    single = build_config({"name": "r"})
    agents = build_config({"name": "r", "rollout": {"workflow": "my.pkg:run"}})
    assert not single.uses_agents and agents.uses_agents
    assert "agent" not in run_roles(single.uses_agents) and "reward" in run_roles(single.uses_agents)
    assert "agent" in run_roles(agents.uses_agents) and "reward" not in run_roles(agents.uses_agents)


def test_weight_transport_settings_are_checked_against_the_trainer(tmp_path: Path) -> None:
    """A GPU transport with a CPU trainer, an unknown transport or a zero bucket names the fix."""
    with pytest.raises(
        ConfigError, match=r"transport 'cuda_ipc' moves weights between GPUs.*use transport gloo"
    ):
        load_config(overrides=["weight_sync.transport=cuda_ipc"])
    with pytest.raises(ConfigError, match=r"weight_sync.transport.*'tcp'"):
        load_config(overrides=["weight_sync.transport=tcp"])
    with pytest.raises(ConfigError, match=r"bucket_mb must be > 0, got 0"):
        load_config(overrides=["weight_sync.bucket_mb=0"])
    cfg = load_config(overrides=["weight_sync.transport=nccl", "trainer.device=cuda"])
    assert (cfg.weight_sync.transport, cfg.weight_sync.bucket_mb) == ("nccl", 512)


def test_bus_transport_settings_name_the_field_and_the_fix() -> None:
    """``transport: bus`` serves local and vLLM engines, not SGLang, its chunk must fit the embedded
    server's max_payload, and it does not carry LoRA adapters."""
    cfg = load_config(overrides=["weight_sync.transport=bus"])
    assert (cfg.weight_sync.anchor_every, cfg.weight_sync.chunk_kb) == (8, 1024)
    cfg = load_config(overrides=["weight_sync.transport=bus", "rollout.engine=vllm"])
    assert (cfg.weight_sync.transport, cfg.rollout.engine) == ("bus", "vllm")
    with pytest.raises(
        ConfigError,
        match=r"'bus' serves local and vllm engines, but rollout.engine is 'sglang'.*use transport disk",
    ):
        load_config(overrides=["weight_sync.transport=bus", "rollout.engine=sglang"])
    with pytest.raises(
        ConfigError, match=r"chunk_kb \(9000\) does not fit.*max_payload_mb \(8.0\).*at most 8188"
    ):
        load_config(overrides=["weight_sync.transport=bus", "weight_sync.chunk_kb=9000"])
    with pytest.raises(ConfigError, match=r"anchor_every must be > 0, got 0"):
        load_config(overrides=["weight_sync.anchor_every=0"])
    with pytest.raises(ConfigError, match=r"transport 'bus' does not carry LoRA adapters.*transport: disk"):
        build_config({"name": "r", "trainer": {"lora": {}}, "weight_sync": {"transport": "bus"}})


def test_a_model_that_is_not_here_is_refused_before_any_worker_starts(tmp_path: Path) -> None:
    from workers.launcher import check_model_available

    check_model_available(str(tmp_path))  # a local directory
    with pytest.raises(
        ConfigError, match=r"'Nobody/NoModel-0.5B' is neither on disk.*hf download Nobody/NoModel-0.5B"
    ):
        check_model_available("Nobody/NoModel-0.5B")
    with pytest.raises(ConfigError, match=r"set model.path to an HF model directory"):
        check_model_available(str(tmp_path / "missing"))


def test_lora_settings_name_the_key_and_the_fix() -> None:
    """``trainer.lora``: absent is full fine-tuning; bad values and in-memory transports are refused."""
    assert build_config({"name": "r"}).trainer.lora is None
    cfg = build_config(
        {"name": "r", "trainer": {"lora": {"rank": 8, "target_modules": ["q_proj", "v_proj"]}}}
    )
    assert cfg.trainer.lora is not None and cfg.trainer.lora.scale == 4.0
    for bad, message in (
        ({"rank": 0}, r"trainer.lora.rank must be an integer >= 1, got 0"),
        ({"alpha": -1}, r"trainer.lora.alpha must be > 0"),
        ({"dropout": 1.0}, r"trainer.lora.dropout must be in \[0, 1\)"),
        ({"target_modules": []}, r"trainer.lora.target_modules must name at least one linear module"),
        ({"rnak": 8}, r"unknown key 'rnak'; did you mean 'rank'"),
    ):
        with pytest.raises(ConfigError, match=message):
            build_config({"name": "r", "trainer": {"lora": bad}})
    with pytest.raises(ConfigError, match=r"transport 'gloo' does not carry LoRA adapters.*transport: disk"):
        build_config({"name": "r", "trainer": {"lora": {}}, "weight_sync": {"transport": "gloo"}})
