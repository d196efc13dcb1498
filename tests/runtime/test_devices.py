"""One device per worker, by one rule: which GPU each device worker owns (``gpu_table``),
what the embedded cluster gives each worker (``worker_environments``), whether ops run on
CUDA (``cuda_choice``), what an engine's processes see (``block_gpus``), and the embedded
workers' memory limits. Pure functions: no GPU is needed to check them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rpeg.errors import RuntimeFailure
from rpeg.runtime.dask.devices import (
    VISIBLE,
    GpuOf,
    Seen,
    block_gpus,
    cuda_choice,
    gpu_table,
    local_index,
    visible_gpus,
    worker_environments,
)
from rpeg.runtime.dask.driver import WORKER_BYTES, worker_memory_limit


@pytest.mark.parametrize("per_node", [1, 4, 8])
def test_workers_that_see_their_whole_node_take_the_gpu_at_their_rank(per_node):
    nodes = 2
    node_gpus = tuple(str(i) for i in range(per_node))
    seen = {d: Seen(f"node{d // per_node}", node_gpus) for d in range(nodes * per_node)}
    table = gpu_table(seen)
    assert [g.index for g in table] == list(range(per_node)) * nodes
    assert {(g.host, g.gpu) for g in table} == {(f"node{n}", g) for n in range(nodes)
                                                for g in node_gpus}   # each GPU once


@pytest.mark.parametrize("per_node", [1, 4, 8])
def test_workers_started_with_one_visible_gpu_use_it_as_cuda_0(per_node):
    # tutorial 05: CUDA_VISIBLE_DEVICES=i dask worker ...: each sees its own GPU only
    seen = {d: Seen(f"node{d // per_node}", (str(d % per_node),)) for d in range(2 * per_node)}
    table = gpu_table(seen)
    assert all(g.index == 0 for g in table)
    assert [g.gpu for g in table] == [str(d % per_node) for d in range(2 * per_node)]


def test_two_workers_on_one_gpu_and_too_few_gpus_are_refused():
    with pytest.raises(RuntimeFailure, match="both own GPU 3"):
        gpu_table({0: Seen("a", ("3",)), 1: Seen("a", ("3",))})
    with pytest.raises(RuntimeFailure, match="see only 2"):
        gpu_table({d: Seen("a", ("0", "1")) for d in range(3)})
    with pytest.raises(RuntimeFailure, match="sees none"):
        local_index(0, 0)


@given(st.lists(st.integers(1, 8), min_size=1, max_size=4))
def test_every_worker_of_a_node_owns_a_distinct_gpu(per_node):
    seen, d = {}, 0
    for n, k in enumerate(per_node):
        for _ in range(k):
            seen[d] = Seen(f"n{n}", tuple(str(i) for i in range(k)))
            d += 1
    table = gpu_table(seen)
    assert len({(g.host, g.gpu) for g in table}) == len(table)


def test_an_engine_block_sees_its_gpus_by_node_ids_host_first_whatever_workers_see():
    # one visible GPU per worker: device indices are all 0, the block's ids are not
    table = tuple(GpuOf(0, str(g), "a") for g in (4, 5, 6, 7))
    assert block_gpus(table, (0, 1, 2, 3)) == "4,5,6,7"      # not "0,0,0,0"
    assert block_gpus(table, (2, 3)) == "6,7"
    with pytest.raises(RuntimeFailure, match="one node"):
        block_gpus((GpuOf(0, "0", "a"), GpuOf(0, "0", "b")), (0, 1))


def test_the_embedded_cluster_gives_each_worker_one_gpu_or_none():
    assert worker_environments(2, None, ("0", "1", "2")) == [{VISIBLE: "0"}, {VISIBLE: "1"}]
    assert worker_environments(2, False, ("0", "1")) == [{VISIBLE: ""}, {VISIBLE: ""}]
    assert worker_environments(2, None, ()) == [{}, {}]            # a CPU machine
    with pytest.raises(RuntimeFailure, match="shows 1 GPU"):
        worker_environments(2, True, ("0",))


def test_visible_gpus_reads_the_variable_else_the_count():
    assert visible_gpus({VISIBLE: "2,3"}) == ("2", "3")
    assert visible_gpus({VISIBLE: ""}) == ()
    assert visible_gpus({}, count=2) == ("0", "1")


def test_cuda_is_automatic_when_every_worker_has_a_gpu():
    assert cuda_choice(None, {0: 1, 1: 1}) is True
    assert cuda_choice(None, {0: 1, 1: 0}) is False
    assert cuda_choice(None, {0: 0}) is False
    assert cuda_choice(False, {0: 1}) is False                     # --cpu
    with pytest.raises(RuntimeFailure, match="devices \\[1\\]"):
        cuda_choice(True, {0: 1, 1: 0})                            # --cuda without a GPU


def test_a_worker_memory_limit_fits_its_devices_host_needs():
    total = 24 << 30
    assert worker_memory_limit(total, 2, 0) == total // 2          # the fair share
    need = 20 << 30                                                # a CPU device's peak
    assert worker_memory_limit(total, 2, need) == need + WORKER_BYTES
    assert worker_memory_limit(total, 2, 40 << 30) == total        # never past the machine


def test_an_engine_in_a_daemonic_worker_is_refused_naming_the_fix():
    from types import SimpleNamespace

    from rpeg.runtime.dask.checkpointing import check_engine_hosts
    from rpeg.spec.model import Engine
    plan = SimpleNamespace(placements=(SimpleNamespace(engine=Engine.VLLM, devices=(0,)),
                                       SimpleNamespace(engine=Engine.TORCH, devices=(1,))))
    ctx = SimpleNamespace(plan=plan)
    workers = {0: "tcp://a:1", 1: "tcp://b:2"}
    check_engine_hosts(ctx, {0: {"daemon": False}, 1: {"daemon": True}}, workers)
    with pytest.raises(RuntimeFailure, match="daemon processes") as e:
        check_engine_hosts(ctx, {0: {"daemon": True}, 1: {"daemon": True}}, workers)
    assert "tcp://a:1" in str(e.value) and "tcp://b:2" not in str(e.value)
    assert "DASK_DISTRIBUTED__WORKER__DAEMON=False" in e.value.hint
