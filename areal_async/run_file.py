"""Run files: YAML in, a typed ``RunConfig`` out, and the resolved config written back.

``load_config(path, overrides)`` reads a YAML run file, applies ``--set a.b=c`` overrides (values
parsed as YAML scalars), and builds the tree (``areal_async.config``). Every problem is a
``ConfigError`` naming the file, the key path, the value and the fix, e.g.::

    ConfigError: configs/a.yaml:rollout: unknown key 'group_sise'; did you mean 'group_size'?

``trainer.loss.preset`` selects a named loss recipe (``areal_async.algo.presets``); this module
applies it: the preset's values first, then the file's own keys over them.

Run-file keys are a stable interface. A key that moved keeps working: ``trainer.megatron.context_parallel``
(before context parallelism was one key for both backends) is read as ``trainer.context_parallel``,
and ``logging.tensorboard: false`` (before ``metrics.loggers``) as ``metrics.loggers`` without
``tensorboard``, each with a warning naming the new key; a file that sets both to different values
is refused.

No torch here: the CLI imports this module and must start fast.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import structlog
import yaml

from areal_async.config import LossConfig, MetricsConfig, RunConfig
from areal_async.errors import ConfigError

log = structlog.get_logger(__name__)


class _RunFileLoader(yaml.SafeLoader):
    """YAML 1.1 as PyYAML reads it, except that ``2e-5`` is a float (YAML 1.2), as a person means it."""


_RunFileLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_RunFileLoader)  # noqa: S506 (a SafeLoader subclass)


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``a.b=c`` into (["a", "b"], value); the value is parsed as a YAML scalar or list."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. --set rollout.group_size=8")
    try:
        value = _load_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {text!r}: value is not valid YAML ({exc.__class__.__name__})") from exc
    return key.strip().split("."), value


def _merge_override(tree: dict[str, Any], keys: list[str], value: Any) -> None:
    node = tree
    for k in keys[:-1]:
        child = node.get(k)
        if not isinstance(child, dict):
            child = {}
            node[k] = child
        node = child
    node[keys[-1]] = value


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """Load a run file, apply ``--set`` overrides, and return the validated ``RunConfig``."""
    source = str(path) if path is not None else "<defaults>"
    raw: Any = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(
                f"{source}: no such file; pass the path of a run file, e.g. configs/arith_cpu.yaml"
            )
        try:
            raw = _load_yaml(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{source}: not valid YAML: {exc}") from exc
        if not isinstance(raw, dict):
            raise ConfigError(
                f"{source}: the top level must be a mapping of sections, got {type(raw).__name__}"
            )
    for text in overrides:
        keys, value = parse_override(text)
        _merge_override(raw, keys, value)
        source = f"{source} (+ --set)" if "--set" not in source else source
    return build_config(raw, source=source)


def build_config(raw: Mapping[str, Any], *, source: str = "<dict>") -> RunConfig:
    """Build a ``RunConfig`` from a plain nested mapping (as read from YAML)."""
    raw = _apply_loss_preset(_read_moved_keys(dict(raw), source), source)
    return _build(RunConfig, raw, source, "")


def _read_moved_keys(raw: dict[str, Any], source: str) -> dict[str, Any]:
    return _read_tensorboard_switch(_read_context_parallel(raw, source), source)


def _read_context_parallel(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """``trainer.megatron.context_parallel`` -> ``trainer.context_parallel`` (the one key of both backends)."""
    trainer = raw.get("trainer")
    if not isinstance(trainer, dict) or not isinstance(trainer.get("megatron"), dict):
        return raw
    megatron = trainer["megatron"]
    if "context_parallel" not in megatron:
        return raw
    value = megatron["context_parallel"]
    if "context_parallel" in trainer and trainer["context_parallel"] != value:
        raise ConfigError(
            f"{source}:trainer: trainer.megatron.context_parallel={value!r} and "
            f"trainer.context_parallel={trainer['context_parallel']!r} disagree; context parallelism is one "
            "key for both backends now: keep trainer.context_parallel and delete trainer.megatron.context_parallel"
        )
    log.warning(
        "run-file key moved",
        source=source,
        key="trainer.megatron.context_parallel",
        value=value,
        fix=f"write trainer.context_parallel: {value!r} instead (read as that key)",
    )
    trainer = dict(trainer)
    trainer["megatron"] = {k: v for k, v in megatron.items() if k != "context_parallel"}
    trainer["context_parallel"] = value
    raw["trainer"] = trainer
    return raw


def _read_tensorboard_switch(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """``logging.tensorboard: BOOL`` -> ``metrics.loggers`` with or without ``tensorboard``."""
    logging = raw.get("logging")
    if not isinstance(logging, dict) or "tensorboard" not in logging:
        return raw
    value = logging["tensorboard"]
    if not isinstance(value, bool):
        raise ConfigError(f"{source}:logging.tensorboard: expected true or false, got {value!r}")
    metrics = raw.get("metrics")
    metrics = dict(metrics) if isinstance(metrics, dict) else {}
    loggers = metrics.get("loggers")
    if isinstance(loggers, list):
        if ("tensorboard" in loggers) != value:
            raise ConfigError(
                f"{source}:logging: logging.tensorboard={value!r} and metrics.loggers={loggers!r} disagree; "
                "the trackers are one key now: keep metrics.loggers and delete logging.tensorboard"
            )
    else:
        default = [name for name in MetricsConfig().loggers if name != "tensorboard"]
        metrics["loggers"] = ["tensorboard", *default] if value else default
    log.warning(
        "run-file key moved",
        source=source,
        key="logging.tensorboard",
        value=value,
        fix=f"write metrics.loggers: {metrics['loggers']!r} instead (read as that key)",
    )
    raw["logging"] = {k: v for k, v in logging.items() if k != "tensorboard"}
    raw["metrics"] = metrics
    return raw


def _apply_loss_preset(raw: dict[str, Any], source: str) -> dict[str, Any]:
    trainer = raw.get("trainer")
    loss = trainer.get("loss") if isinstance(trainer, dict) else None
    preset = loss.get("preset") if isinstance(loss, dict) else None
    if preset is None:
        preset = LossConfig.preset
    from areal_async.algo.presets import PRESETS  # torch-free table of recipes

    if preset not in PRESETS:
        raise ConfigError(
            f"{source}:trainer.loss.preset: unknown preset {preset!r}{_hint(str(preset), PRESETS)}; "
            f"choose one of {sorted(PRESETS)}"
        )
    merged = {k: v for k, v in PRESETS[preset].items() if k != "preset"}
    merged.update(loss or {})
    merged["preset"] = preset
    trainer = dict(trainer) if isinstance(trainer, dict) else {}
    trainer["loss"] = merged
    raw["trainer"] = trainer
    return raw


def _hint(name: str, choices: Any) -> str:
    match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {match[0]!r}?" if match else ""


def _build(cls: type, raw: Any, source: str, where: str) -> Any:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{source}:{where or '<top>'}: expected a mapping of keys, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in fields:
            raise ConfigError(
                f"{source}:{where or '<top>'}: unknown key {key!r}{_hint(str(key), fields)}"
                + ("" if _hint(str(key), fields) else f"; valid keys: {', '.join(fields)}")
            )
        kwargs[key] = _coerce(hints[key], value, source, path)
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{source}:{where or '<top>'}: {exc}") from exc


def _coerce(tp: Any, value: Any, source: str, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, source, path)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, source, path)
            except ConfigError as exc:
                errors.append(str(exc))
        if len(errors) == 1:  # `X | None`: X's own error names the key and the fix
            raise ConfigError(errors[0])
        raise ConfigError(f"{source}:{path}: value {value!r} is not a valid {_type_name(tp)}")
    if origin is Literal:
        if value not in args:
            choices = ", ".join(repr(a) for a in args)
            hint = _hint(str(value), [str(a) for a in args])
            raise ConfigError(f"{source}:{path}: {value!r} is not one of {choices}{hint}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{source}:{path}: expected a list, got {value!r}")
        (item,) = args or (Any,)
        return [_coerce(item, v, source, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}:{path}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{source}:{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{source}:{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{source}:{path}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{source}:{path}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{source}:{path}: unsupported type {tp!r}")  # our own schema bug


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """The resolved config as plain data (what each worker writes into the run dir)."""
    return dataclasses.asdict(cfg)


def write_resolved_config(cfg: RunConfig, role: str) -> Path:
    """Write the resolved config to ``<run_dir>/config/<role>.yaml`` and return the path."""
    out = cfg.run_dir / "config"
    out.mkdir(parents=True, exist_ok=True)
    target = out / f"{role}.yaml"
    tmp = target.with_suffix(".yaml.tmp")
    tmp.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    tmp.replace(target)
    return target
