"""trainer.malloc_arenas: threads of a trainer process share the arenas it allows; the environment wins."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import ctypes, os, re, sys, tempfile, threading
from workers.runtime import limit_malloc_arenas
applied = limit_malloc_arenas(int(sys.argv[1]))
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.fdopen.restype = ctypes.c_void_p
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
start = threading.Barrier(4)
def work():
    start.wait()  # all four allocate at once: glibc gives each a new arena while it may
    blocks = [libc.malloc(4096) for _ in range(1000)]
    for b in blocks:
        libc.free(b)
threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
with tempfile.TemporaryFile("w+") as f:
    stream = libc.fdopen(os.dup(f.fileno()), b"w")
    libc.malloc_info(0, stream)
    libc.fclose(stream)
    f.seek(0)
    heaps = len(re.findall(r'<heap nr="', f.read()))
print(applied, heaps)
"""


def arenas_used(limit: int, arena_max_env: str | None = None) -> tuple[bool, int]:
    """(applied, arenas) of a fresh process that calls limit_malloc_arenas(limit), then allocates in
    four threads at once; ``arena_max_env``: its MALLOC_ARENA_MAX."""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    if arena_max_env is not None:
        env["MALLOC_ARENA_MAX"] = arena_max_env
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(limit)], capture_output=True, text=True, check=True, env=env
    ).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_one_arena_serves_every_thread_unless_the_environment_says_otherwise() -> None:
    assert arenas_used(1) == (True, 1)
    applied, arenas = arenas_used(0)  # 0: glibc's default, an arena per thread allocating at once
    assert not applied and arenas >= 3
    applied, arenas = arenas_used(1, arena_max_env="4")
    assert not applied and 1 < arenas <= 4
