"""What a checkpoint's files cost on this machine: written and fsync'd to the run's
filesystem, and hashed (SHA-256) by the process that wrote them.

    >>> m = measure_checkpoint_io(Path("~/.cache/rpeg"))          # doctest: +SKIP
    >>> m["disk_bandwidth"] / 1e9, m["hash_bandwidth"] / 1e9      # doctest: +SKIP
    (1.1, 1.6)

A checkpoint's writer writes its files and fsyncs them, then hashes them from its page
cache (``rpeg.runtime.rundir.checkpoints.save_replicas``): ``disk_bandwidth`` is the rate
of writing :data:`SIZE` bytes into a file in ``where`` (the folder whose filesystem the
runs' and the cache's folders are on) through its fsync, ``hash_bandwidth`` the rate of
``hashlib.sha256`` over as many bytes in memory; each the median of :data:`REPEATS`
tries (a fraction of a second together), priced by ``rpeg.cost.checkpoint.save_time``.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import tempfile
import time
from pathlib import Path

SIZE = 64 << 20              # bytes a try writes, and hashes
REPEATS = 3


def measure_checkpoint_io(where: Path, size: int = SIZE, repeats: int = REPEATS) -> dict:
    """``disk_bandwidth`` and ``hash_bandwidth`` (bytes/s) measured in folder ``where``
    (made if missing; the file written there is removed)."""
    where = Path(where).expanduser()
    where.mkdir(parents=True, exist_ok=True)
    data = os.urandom(size)
    hashed, written = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        hashlib.sha256(data).hexdigest()
        hashed.append(time.perf_counter() - t)
        fd, path = tempfile.mkstemp(prefix=".rpeg-disk-", dir=where)
        try:
            t = time.perf_counter()
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            written.append(time.perf_counter() - t)
        finally:
            os.unlink(path)
    return {"disk_bandwidth": size / statistics.median(written),
            "hash_bandwidth": size / statistics.median(hashed), "bytes": size,
            "repeats": repeats}


__all__ = ["REPEATS", "SIZE", "measure_checkpoint_io"]
