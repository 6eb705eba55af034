"""Files written so that a crash or an interruption never leaves a torn one: the bytes go to a
temporary file beside the target, are flushed to disk, and replace the target in one rename
(then the directory entry is flushed too). A reader sees the old file or the new, never half."""

from __future__ import annotations

import io
import os
from pathlib import Path


def fsync_dir(path) -> None:
    """Flush a directory's entries (the rename); a file system that cannot is left as it is."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_bytes_atomic(path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_text_atomic(path, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def write_csv_atomic(df, path) -> None:
    """A DataFrame as CSV (no index)."""
    write_text_atomic(path, df.to_csv(index=False))


def write_parquet_atomic(df, path) -> None:
    """A DataFrame as parquet (no index)."""
    buf = io.BytesIO()
    df.to_parquet(buf, index=False)
    write_bytes_atomic(path, buf.getvalue())
