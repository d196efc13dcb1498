"""A collective waits ``init_world``'s timeout for its partners, then fails (``rpeg run
--collective-timeout``): a rank left alone in an all-reduce raises while its partner is
still alive and waiting, instead of blocking the run until the partner goes away."""

from __future__ import annotations

from tests.backends.ranks import answers

TIMEOUT_S = 3.0
PARTNER_WAITS_S = 300.0     # far past the timeout: the partner outlives the lone rank's wait


def _rank(rank: int, port: int, q, alone) -> None:
    import torch
    import torch.distributed as dist

    from backends.torch_backend import distributed as D
    D.init_world(rank, 2, f"tcp://127.0.0.1:{port}", [(0, 1)], timeout_s=TIMEOUT_S)
    if rank == 0:
        try:
            dist.all_reduce(torch.ones(4))
            q.put((0, "completed"))
        except Exception as e:                           # gloo's timeout error
            q.put((0, f"raised: {e}"))
        finally:
            alone.set()
    else:                                                # joins, never enters the all-reduce
        q.put((1, alone.wait(PARTNER_WAITS_S)))


def test_a_collective_fails_after_the_worlds_timeout_not_when_its_partner_leaves():
    import multiprocessing as mp
    alone = mp.get_context("spawn").Event()
    got = dict(answers(_rank, 2, alone, timeout=PARTNER_WAITS_S + 60))
    assert got[0].startswith("raised"), got[0]
    assert "timed out" in got[0].lower() or "timeout" in got[0].lower(), got[0]
    assert got[1] is True            # the partner was still waiting when rank 0 gave up
