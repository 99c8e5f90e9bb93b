"""Logging set-up: structlog, console on a terminal, JSON lines otherwise.

``configure_logging(role=..., worker_id=..., rank=...)`` is called once per process;
the identifiers are bound into every line so per-role JSON logs can be merged and
filtered. Tests read the JSON lines rather than console text.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, TextIO

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure_logging(
    *,
    level: str = "info",
    fmt: str = "auto",
    stream: TextIO | None = None,
    json_file: Path | None = None,
    **bound: Any,
) -> structlog.stdlib.BoundLogger:
    """Configure structlog for this process and return a logger with ``bound`` fields.

    ``fmt`` is ``auto`` (console on a TTY, JSON otherwise), ``console`` or ``json``.
    ``json_file`` additionally appends JSON lines to a file (the per-role log in the run dir).
    """
    if level not in _LEVELS:
        raise ValueError(f"logging.level must be one of {sorted(_LEVELS)}, got {level!r}")
    if fmt not in ("auto", "console", "json"):
        raise ValueError(f"logging.format must be 'auto', 'console' or 'json', got {fmt!r}")
    stream = stream or sys.stderr
    use_console = fmt == "console" or (fmt == "auto" and stream.isatty())
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        structlog.processors.format_exc_info,
    ]
    json_renderer = structlog.processors.JSONRenderer()
    renderer = structlog.dev.ConsoleRenderer(colors=stream.isatty()) if use_console else json_renderer
    file_handle = open(json_file, "a", buffering=1) if json_file else None  # noqa: SIM115 - lives with the process

    def _tee(logger: Any, method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
        if file_handle is not None:
            file_handle.write(json_renderer(logger, method, dict(event_dict)) + "\n")
        return event_dict

    structlog.configure(
        processors=[*shared, _tee, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    # Libraries that log through the standard library (nats, transformers) go to the same stream.
    logging.basicConfig(level=max(_LEVELS[level], logging.WARNING), stream=stream, force=True)
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(**{k: v for k, v in bound.items() if v is not None})
    return structlog.get_logger()
