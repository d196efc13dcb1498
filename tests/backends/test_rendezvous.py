"""The store a world's ranks meet at listens on the rendezvous host's address alone, not on
every interface as torch's ``tcp://`` rendezvous does; a world of real gloo ranks still
meets there and reduces."""

from __future__ import annotations

import datetime

from tests.backends.ranks import answers, free_port

TIMEOUT = datetime.timedelta(seconds=60)


def listening(port: int) -> set[str]:
    """The addresses this process listens on at ``port``."""
    import psutil
    return {c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def test_rank_0_serves_the_store_on_the_host_alone():
    import torch.distributed as dist

    from backends.torch_backend.distributed import rendezvous_store
    port = free_port()
    store = rendezvous_store(f"tcp://127.0.0.1:{port}", 0, 2, TIMEOUT, wait_for_workers=False)
    other = rendezvous_store(f"tcp://127.0.0.1:{port}", 1, 2, TIMEOUT, wait_for_workers=False)
    assert listening(port) == {"127.0.0.1"}
    store.set("k", b"v")
    assert other.get("k") == b"v"
    del store, other
    # what torch's own rendezvous makes: the same store, on every interface
    port = free_port()
    theirs = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=TIMEOUT)
    assert theirs.port == port and listening(port) & {"0.0.0.0", "::"}, listening(port)


def _rank(rank: int, port: int, q) -> None:
    import torch
    import torch.distributed as dist

    from backends.torch_backend.distributed import init_world
    init_world(rank, 2, f"tcp://127.0.0.1:{port}", [(0, 1)])
    t = torch.ones(3) * (rank + 1)
    dist.all_reduce(t)
    q.put((rank, t.tolist(), sorted(listening(port))))
    dist.barrier()


def test_a_world_meets_at_its_store_and_reduces():
    got = {r: rest for r, *rest in answers(_rank, 2)}
    assert got == {0: [[3.0] * 3, ["127.0.0.1"]], 1: [[3.0] * 3, []]}
