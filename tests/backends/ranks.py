"""Real gloo ranks for a test: ``answers(target, n, *args)`` starts ``n`` spawned processes
``target(rank, port, queue, *args)`` meeting at a free port, and returns what they put on
the queue (``count`` answers, default one per rank), within a hang guard."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(target, n: int, *args, count: int | None = None, timeout: float = 600.0) -> list:
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, q, *args)) for r in range(n)]
    for p in procs:
        p.start()
    try:
        return [q.get(timeout=timeout) for _ in range(n if count is None else count)]
    finally:                                    # a hang guard, not a speed target
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
