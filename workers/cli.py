"""Command-line entry points: ``areal-worker`` (one role, one process) and ``areal-async``.

    areal-worker --role trainer --config configs/arith_cpu.yaml [--set trainer.batch_size=8 ...]
    areal-async run configs/arith_cpu.yaml          # embedded nats-server + one process per role
    areal-async inspect --config configs/arith_cpu.yaml [tail SUBJECT]
    areal-async dashboard --config configs/arith_cpu.yaml [--port 8750]   # read-only web page
    areal-async sft RUN.yaml [--set sft.epochs=2 ...]   # supervised warm start (torchrun: N ranks)
    areal-async prepare-model smollm2 [--out DIR]

Imports are lazy: ``--help`` of both commands loads neither torch nor transformers.
Exit codes: 0 done, 1 runtime failure, 2 bad usage or configuration, 130 interrupted.
A failure a user can act on (configuration, bus, nats-server, file system) is one line on
stderr, ``error: <Type>: <what and the fix>``, never a traceback; a traceback means a bug.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Sequence

from workers.roles import ROLE_MODULES, ROLES


def _passive_openmp() -> None:
    """OpenMP threads that wait at a barrier sleep rather than spin, unless ``OMP_WAIT_POLICY`` is
    set already. On a CPU machine the trainer's threads share the cores with the engine and the
    other roles (and their child processes inherit this), and threads spinning at each barrier
    take the cores the others need: on 2 cores the demo's first step, beside the version-0
    evaluation, computed in 87 s spinning against 26 s passive. OpenMP reads it when torch loads
    it, so this runs before anything imports torch."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _fail(message: str, code: int = 2) -> int:
    sys.stderr.write(f"error: {message}\n")
    return code


def _user_error(exc: BaseException) -> BaseException | None:
    """The error a user can act on in ``exc`` (also inside an exception group), or None for a bug.

    Bus and nats errors are only looked up when their modules are loaded: an error raised before
    the bus was imported cannot be one of them, and ``--help`` must not import nats.
    """
    if isinstance(exc, BaseExceptionGroup):
        return next((found for e in exc.exceptions if (found := _user_error(e)) is not None), None)
    from areal_async.errors import AreaLError

    known: list[type[BaseException]] = [AreaLError, ValueError, OSError]
    for module, name in (
        ("bus.errors", "BusError"),
        ("bus.embedded", "EmbeddedServerError"),
        ("nats.errors", "Error"),
    ):
        if module in sys.modules:
            known.append(getattr(sys.modules[module], name))
    return exc if isinstance(exc, tuple(known)) else None


def _report(exc: Exception) -> int:
    """One line on stderr for a user's error (exit 2 for a bad value, configuration included, or a
    refused permission; else 1); anything else is a bug and is raised with its traceback."""
    found = _user_error(exc)
    if found is None:
        raise exc
    bus_errors = sys.modules.get("bus.errors")
    usage = isinstance(found, ValueError) or (
        bus_errors is not None and isinstance(found, bus_errors.BusPermissionError)
    )
    first, *rest = (str(found) or repr(found)).splitlines() or [""]
    return _fail(f"{type(found).__name__}: {first}{' [...]' if rest else ''}", code=2 if usage else 1)


def worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="areal-worker",
        description="Run one areal-async worker role. Every role connects to the run's NATS bus; "
        "any number of generation and reward workers may join or leave at any time.",
    )
    p.add_argument("--role", required=True, choices=ROLES, help="worker role to run")
    p.add_argument("--config", required=True, help="YAML run file")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set rollout.group_size=8 (repeatable)",
    )
    p.add_argument("--worker-id", default=None, help="stable id of this worker (default: role-host-pid)")
    return p


def worker_main(argv: Sequence[str] | None = None) -> int:
    _passive_openmp()
    args = worker_parser().parse_args(argv)
    try:
        return _run_worker(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        return _report(exc)


def _run_worker(args: argparse.Namespace) -> int:
    from areal_async.run_file import load_config

    cfg = load_config(args.config, args.overrides)
    if args.role == "trainer":  # before torch starts its threads
        from workers.runtime import limit_malloc_arenas

        limit_malloc_arenas(cfg.trainer.malloc_arenas)
    try:
        module = importlib.import_module(ROLE_MODULES[args.role])
    except ModuleNotFoundError as exc:
        if exc.name != ROLE_MODULES[args.role]:
            raise
        return _fail(f"role {args.role!r} is not implemented in this build", code=2)
    if args.role == "trainer" and module.is_follower():
        return module.follow(cfg)  # torchrun ranks > 0 only compute
    from workers.runtime import run_fleet, run_role

    fleet = cfg.simulation.engines_per_worker
    if args.role == "generation" and cfg.rollout.engine == "simulated" and fleet > 1:
        return run_fleet(cfg, role=args.role, serve=module.serve, count=fleet, worker_id=args.worker_id)
    return run_role(cfg, role=args.role, serve=module.serve, worker_id=args.worker_id)


def main_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="areal-async",
        description="Asynchronous RL for language models: run, inspect and prepare areal-async runs.",
    )
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="start an embedded nats-server and one process per role on this machine")
    run.add_argument("config", help="YAML run file")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    run.add_argument(
        "--roles",
        default=None,
        help="comma-separated roles to start (default: every role the run needs; agent only for agent workflows)",
    )
    run.add_argument("--no-live", action="store_true", help="plain log lines instead of the live display")
    run.add_argument(
        "--dashboard", action="store_true", help="also serve the web dashboard (127.0.0.1; prints its URL)"
    )
    run.add_argument(
        "--dashboard-port", type=int, default=None, help="its port (default 8750; 0: any free one)"
    )

    dash = sub.add_parser(
        "dashboard",
        help="a read-only web page of a running or finished run (fleet, steps, rollouts, dead letters)",
    )
    from workers.dashboard import add_arguments

    add_arguments(dash)

    ins = sub.add_parser("inspect", help="show streams, consumers, KV state, live workers and dead letters")
    ins.add_argument("--config", help="YAML run file (gives run name and bus URL)")
    ins.add_argument("--url", help="NATS URL (default: from the config or the run dir)")
    ins.add_argument("--run", dest="run_name", help="run name (default: from the config)")
    ins.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ins.add_argument(
        "what", nargs="?", default="summary", choices=("summary", "tail", "steps", "deadletter", "health")
    )
    ins.add_argument("subject", nargs="?", help="for 'tail': subject under areal.<run>. (e.g. trainer.step)")
    ins.add_argument("--count", type=int, default=10, help="events to show for tail/steps/deadletter")
    ins.add_argument("--json", action="store_true", help="machine-readable output")

    exp = sub.add_parser("export", help="copy a run's trained weights (a version) out as a model directory")
    exp.add_argument("config", help="YAML run file of the run")
    exp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    exp.add_argument("--out", required=True, help="new directory to write")
    exp.add_argument(
        "--version", type=int, default=None, help="weights version (default: the newest on disk)"
    )
    exp.add_argument(
        "--merge-lora",
        action="store_true",
        help="LoRA runs: merge the adapter into the base model (a plain HF model)",
    )

    sft = sub.add_parser(
        "sft",
        help="supervised fine-tuning on the run file's model and trainer (a warm start before RL); "
        "under torchrun (-m workers sft) on every rank",
    )
    sft.add_argument("config", help="YAML run file with an sft section")
    sft.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")

    prep = sub.add_parser("prepare-model", help="convert a bundled model to a safetensors HF directory")
    prep.add_argument("name", choices=("smollm2",), help="model to prepare")
    prep.add_argument("--out", default=None, help="output directory (default: the areal-async cache)")
    prep.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    _passive_openmp()
    args = main_parser().parse_args(argv)
    try:
        if args.command == "run":
            from workers.launcher import launch

            roles = args.roles.split(",") if args.roles else None
            dashboard_port = (
                args.dashboard_port if args.dashboard or args.dashboard_port is not None else None
            )
            if dashboard_port is not None or args.dashboard:
                from workers.dashboard import DEFAULT_PORT, require_extra

                require_extra()  # before any worker starts
                dashboard_port = DEFAULT_PORT if dashboard_port is None else dashboard_port
            return launch(
                args.config, args.overrides, roles=roles, live=not args.no_live, dashboard_port=dashboard_port
            )
        if args.command == "dashboard":
            from workers.dashboard import dashboard_main

            return dashboard_main(args)
        if args.command == "inspect":
            from workers.inspect import inspect_main

            return inspect_main(args)
        if args.command == "export":
            from areal_async.run_file import load_config
            from workers.export import describe, export_weights

            cfg = load_config(args.config, args.overrides)
            path = export_weights(cfg, args.out, version=args.version, merge_lora=args.merge_lora)
            sys.stdout.write(json.dumps(describe(path)) + "\n")
            return 0
        if args.command == "sft":
            from workers.sft import sft_main

            return sft_main(args.config, args.overrides)
        if args.command == "prepare-model":
            from areal_async.models import prepare_smollm2

            path = prepare_smollm2(args.out, dtype=args.dtype)
            sys.stdout.write(f"{path}\n")
            return 0
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        return _report(exc)
    return _fail(f"unknown command {args.command!r}")


if __name__ == "__main__":  # torchrun -m workers.cli --role trainer ...
    sys.exit(worker_main())
