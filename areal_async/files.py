"""Crash-safe writes: a directory or small file is replaced whole, and on disk when the call returns.

`fsync_tree` then `replace_dir` commit a directory written under a temporary name (a checkpoint,
a weights directory): a reader sees the old directory or the new one, never a partial one.
`write_text_atomic` does the same for one small file (a pointer such as `checkpoints/latest`).
Standard library only, so any module may import it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Flush a directory entry (after a rename or create) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file directly under `root`, then `root` itself."""
    for p in root.iterdir():
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(root)


def replace_dir(src: Path, dst: Path) -> None:
    """Rename directory `src` to `dst` atomically; an existing `dst` is swapped out, then deleted."""
    old = None
    if dst.exists():
        old = dst.with_name(f".old-{dst.name}-{os.getpid()}")
        os.rename(dst, old)
    os.rename(src, dst)
    fsync_dir(dst.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to a temp file next to `path`, fsync, and rename over `path`."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
