"""RewardPool: reward functions in worker processes, with a timeout a hang cannot defeat.

    async with RewardPool("gsm8k", num_workers=4, timeout_s=10.0) as pool:
        outcomes = await pool.score(completions, row)   # one RewardOutcome per completion

Guarantees:

- Every completion gets a RewardOutcome, in input order. A function that raises, returns
  a non-number, kills its process, or runs past ``timeout_s`` yields reward 0.0 with
  the error recorded; ``score`` itself does not raise for any of these.
- A worker that overruns the timeout is killed (SIGKILL) and its slot restarts a fresh
  process on next use; calls running on other workers are not touched.
- ``aclose()`` (or leaving the ``async with``) stops every worker process and waits for
  it: no process outlives the pool. Workers also exit on their own if the parent dies.

Design: ``concurrent.futures.ProcessPoolExecutor`` cannot kill one stuck worker, so
this is a small pool of its own. Each worker is a ``spawn`` process (safe from threads,
async code and a parent that has torch/CUDA loaded) with one duplex pipe, serving one
call at a time. A slot semaphore hands a free worker to each call; the call waits on
the pipe without blocking the event loop (``anyio.wait_readable``) under its own
timeout. ``async def`` reward functions run inside the worker with ``asyncio.run``.
A reward function cannot itself start multiprocessing children (workers are daemonic);
``subprocess`` and threads are fine.
"""

from __future__ import annotations

import collections
import itertools
import multiprocessing
import os
import signal
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
import structlog

from areal_async.rewards.registry import (
    RewardSpecError,
    as_reward,
    resolve_reward,
    reward_import_path,
    run_reward,
)

log = structlog.get_logger()

_MAX_ERROR_CHARS = 500


@dataclass(frozen=True, slots=True)
class RewardOutcome:
    """The result of one reward call: ``error`` is None on success, else why ``reward`` is 0.0."""

    reward: float
    error: str | None
    seconds: float


@dataclass(eq=False, slots=True)
class _Worker:
    process: BaseProcess
    conn: Connection

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid


class RewardPool:
    """Score completions with ``fn_spec`` (a built-in name or ``package.module:function``) in processes."""

    def __init__(
        self,
        fn_spec: str,
        *,
        num_workers: int = 2,
        timeout_s: float = 10.0,
        start_timeout_s: float = 60.0,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if timeout_s <= 0 or start_timeout_s <= 0:
            raise ValueError(
                f"timeouts must be > 0, got timeout_s={timeout_s}, start_timeout_s={start_timeout_s}"
            )
        self.fn_spec = fn_spec
        self.import_path = reward_import_path(fn_spec)  # shape now; import errors surface in start()
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self._mp = multiprocessing.get_context("spawn")
        self._idle: collections.deque[_Worker | None] = collections.deque([None] * num_workers)
        self._slots = anyio.Semaphore(num_workers)
        self._start_lock = anyio.Lock()
        self._live: dict[int, _Worker] = {}
        self._processes: set[BaseProcess] = set()
        self._call_ids = itertools.count()
        self._started = False
        self._closed = False

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the running workers (idle or busy)."""
        return sorted(self._live)

    async def __aenter__(self) -> RewardPool:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Start all workers and wait until each has imported the reward function.

        RewardSpecError when the function does not import in a worker; TimeoutError
        when a worker is not ready within ``start_timeout_s``. ``score`` calls this lazily.
        """
        async with self._start_lock:
            self._check_open()
            if self._started:
                return
            workers: list[_Worker] = []
            try:
                for _ in range(self.num_workers):  # all boot in parallel; readiness is awaited below
                    workers.append(await self._launch())
                for worker in workers:
                    await self._await_ready(worker)
            except BaseException:
                for worker in workers:
                    self._discard(worker)
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(_join_all, [w.process for w in workers], 5.0)
                raise
            self._idle = collections.deque(workers)
            self._started = True
        log.info(
            "reward pool started", reward=self.fn_spec, num_workers=self.num_workers, pids=self.worker_pids
        )

    async def score(self, completions: Sequence[str], row: Mapping[str, Any]) -> list[RewardOutcome]:
        """Score every completion against ``row`` in parallel; one outcome per completion, in order.

        RuntimeError when the pool is closed; calls cut short by ``aclose`` end with an error outcome.
        """
        self._check_open()
        if not self._started:
            await self.start()
        row = dict(row)
        outcomes: list[RewardOutcome | None] = [None] * len(completions)

        async def score_into(i: int, completion: str) -> None:
            outcomes[i] = await self._score_one(completion, row)

        async with anyio.create_task_group() as tg:
            for i, completion in enumerate(completions):
                tg.start_soon(score_into, i, completion)
        assert all(o is not None for o in outcomes)
        return outcomes  # type: ignore[return-value]

    async def aclose(self) -> None:
        """Stop every worker and wait for the processes to exit. Calls in flight end with an error."""
        if self._closed:
            return
        self._closed = True
        idle = [w for w in self._idle if w is not None]
        self._idle.clear()
        for worker in idle:
            try:
                worker.conn.send(("stop",))
            except OSError:
                worker.process.kill()
        for worker in self._live.values():
            if worker not in idle:  # busy: its call sees EOF, reports "pool closed" and discards the worker
                worker.process.kill()
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(_join_all, list(self._processes), 5.0)
        for worker in idle:
            self._discard(worker)
        self._processes = {p for p in self._processes if p.exitcode is None}
        log.info("reward pool closed", reward=self.fn_spec)

    async def _score_one(self, completion: str, row: dict[str, Any]) -> RewardOutcome:
        async with self._slots:
            if self._closed:
                return RewardOutcome(0.0, "reward pool closed before scoring", 0.0)
            worker = self._idle.popleft()
            keep = False
            try:
                if worker is None:
                    try:
                        worker = await self._start_worker()
                    except Exception as e:
                        log.error("reward worker failed to start", reward=self.fn_spec, error=str(e))
                        return RewardOutcome(0.0, f"reward worker failed to start: {e}", 0.0)
                outcome, keep = await self._call(worker, completion, row)
                return outcome
            finally:
                if worker is not None and (not keep or self._closed):
                    self._discard(worker)
                    worker = None
                if not self._closed:
                    self._idle.append(worker)

    async def _call(
        self, worker: _Worker, completion: str, row: dict[str, Any]
    ) -> tuple[RewardOutcome, bool]:
        """One call on ``worker``: ``(outcome, whether the worker is fit to keep)``."""
        call_id = next(self._call_ids)
        started = time.monotonic()
        try:
            worker.conn.send(("score", call_id, completion, row))
        except OSError as e:
            return RewardOutcome(0.0, f"reward worker {worker.pid} is gone ({e})", 0.0), False
        reply: Any = None
        with anyio.move_on_after(self.timeout_s) as scope:
            try:
                await anyio.wait_readable(worker.conn)
                reply = worker.conn.recv()
            except (EOFError, OSError):
                reply = None
        elapsed = time.monotonic() - started
        if scope.cancelled_caught:
            log.warning("reward timed out; replacing worker", pid=worker.pid, timeout_s=self.timeout_s)
            error = f"timed out after {self.timeout_s:g} s (worker {worker.pid} killed and replaced)"
            return RewardOutcome(0.0, error, elapsed), False
        if reply is None:
            if self._closed:
                return RewardOutcome(0.0, "reward pool closed while scoring", elapsed), False
            await anyio.to_thread.run_sync(worker.process.join, 1.0)
            exit_code = worker.process.exitcode
            log.warning("reward worker died; replacing it", pid=worker.pid, exit_code=exit_code)
            error = f"reward worker {worker.pid} died while scoring (exit code {exit_code})"
            return RewardOutcome(0.0, error, elapsed), False
        kind, reply_id, reward, error, seconds = reply
        assert kind == "done" and reply_id == call_id, f"reply {kind}/{reply_id} to call {call_id}"
        return RewardOutcome(float(reward), error, float(seconds)), True

    async def _start_worker(self) -> _Worker:
        worker = await self._launch()
        try:
            await self._await_ready(worker)
        except BaseException:
            self._discard(worker)
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(_join_all, [worker.process], 5.0)
            raise
        log.info("reward worker started", pid=worker.pid, reward=self.fn_spec)
        return worker

    async def _launch(self) -> _Worker:
        """Start one worker process (blocking spawn work runs in a thread, shielded so it is never orphaned)."""
        with anyio.CancelScope(shield=True):
            worker = await anyio.to_thread.run_sync(self._launch_blocking)
        self._live[worker.pid] = worker
        self._processes.add(worker.process)
        if self._closed:
            self._discard(worker)
            raise RuntimeError("RewardPool is closed")
        return worker

    def _launch_blocking(self) -> _Worker:
        parent_end, child_end = self._mp.Pipe(duplex=True)
        process = self._mp.Process(
            target=_worker_main,
            args=(child_end, self.import_path, os.getpid()),
            name="areal-reward-worker",
            daemon=True,
        )
        process.start()
        child_end.close()
        return _Worker(process=process, conn=parent_end)

    async def _await_ready(self, worker: _Worker) -> None:
        try:
            with anyio.fail_after(self.start_timeout_s):
                await anyio.wait_readable(worker.conn)
                message = worker.conn.recv()
        except TimeoutError:
            raise TimeoutError(
                f"reward worker {worker.pid} for {self.fn_spec!r} was not ready within {self.start_timeout_s:g} s"
            ) from None
        except (EOFError, OSError):
            await anyio.to_thread.run_sync(worker.process.join, 1.0)
            raise RuntimeError(
                f"reward worker {worker.pid} for {self.fn_spec!r} exited during start-up"
                f" (exit code {worker.process.exitcode}); see its stderr"
            ) from None
        if message[0] == "error":
            raise RewardSpecError(message[1])
        assert message == ("ready", worker.pid), message

    def _discard(self, worker: _Worker) -> None:
        """Kill ``worker`` (if still running) and forget it; reaping is non-blocking here, blocking in aclose."""
        self._live.pop(worker.pid, None)
        if worker.process.exitcode is None:
            worker.process.kill()
        worker.conn.close()
        for process in list(self._processes):
            process.join(timeout=0)
            if process.exitcode is not None:
                self._processes.discard(process)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("RewardPool is closed")


def _join_all(processes: list[BaseProcess], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.exitcode is None:
            process.kill()
            process.join()


def _worker_main(conn: Connection, import_path: str, parent_pid: int) -> None:
    """Body of a worker process: import the function, then serve calls until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the parent decides
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), name="orphan-watch", daemon=True).start()
    try:
        fn = resolve_reward(import_path)
    except Exception as e:
        conn.send(("error", str(e)))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message[0] == "stop":
            return
        _, call_id, completion, row = message
        started = time.perf_counter()
        reward, error = 0.0, None
        try:
            result = run_reward(fn, completion, row)
        except BaseException as e:  # the function's failure is the call's result, not the worker's
            error = _describe(e)
        else:
            try:
                reward = as_reward(result)
            except (TypeError, ValueError) as e:
                error = str(e)
        conn.send(("done", call_id, reward, error, time.perf_counter() - started))


def _describe(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    where = (
        f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    )
    text = f"{type(error).__name__}: {error}{where}"
    return text if len(text) <= _MAX_ERROR_CHARS else text[: _MAX_ERROR_CHARS - 3] + "..."


def _exit_when_orphaned(parent_pid: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(0)
