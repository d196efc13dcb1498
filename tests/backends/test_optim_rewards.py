"""Learning-rate schedules, the overlong reward and dynamic sampling against hand-worked values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from backends.api import RolloutChunk
from backends.torch_backend import sampling
from backends.torch_backend.optim import lr_at
from backends.torch_backend.rewards import Texts, overlong
from rpeg.spec.model import Optimizer, Reward


@pytest.mark.parametrize(("schedule", "want"), [
    # warmup 2: 1/2, then lr; the decay runs over steps 2..9 (span 7)
    ("constant", [0.5, 1.0, 1.0, 1.0, 1.0]),
    ("linear", [0.5, 1.0, 1.0, 1.0 - 0.9 * 3 / 7, 0.1]),
    ("cosine", [0.5, 1.0, 1.0, 0.1 + 0.45 * (1 + math.cos(math.pi * 3 / 7)), 0.1]),
])
def test_schedules(schedule, want):
    o = Optimizer("adamw", lr=1.0, schedule=schedule, warmup=2, min_lr=0.1)
    got = [lr_at(o, 1.0, step, steps=10) for step in (0, 1, 2, 5, 9)]
    assert got == pytest.approx(want)


def test_no_warmup_starts_at_lr():
    assert lr_at(Optimizer("adam", lr=0.5), 0.5, 0, steps=3) == 0.5


def test_overlong_penalty():
    # max 10, buffer 4: 0 up to 6 tokens, then (6 - L) / 4, -1 from 10 on
    x = Texts(("",) * 5, ("",) * 5, ("",) * 5, (3, 6, 7, 10, 12), budget=20)
    r = Reward("long", "", "", kind="overlong", params=(("max_len", 10), ("buffer", 4)))
    assert overlong(r, x).tolist() == pytest.approx([0, 0, -0.25, -1, -1])
    # defaults: max_len = the budget, buffer = a quarter of it
    x = Texts(("",) * 2, ("",) * 2, ("",) * 2, (15, 18), budget=20)
    assert overlong(Reward("long", "", "", kind="overlong"), x).tolist() == \
        pytest.approx([0, -0.6])


def _chunk(index, rnd=0):
    n = len(index)
    return RolloutChunk(np.asarray(index), tuple(np.zeros(1, np.int64) for _ in range(n)),
                        tuple(np.full(2 + rnd, 7, np.int64) for _ in range(n)),
                        tuple(np.zeros(2 + rnd, np.float32) for _ in range(n)),
                        np.ones(n, bool), 0)


def test_dynamic_sampling_refills_degenerate_groups_within_the_rounds():
    """Groups of 2 at positions 0..5 (3 groups). Round 0: group 1 is degenerate; round 1
    refills it (positions 2, 3 at 6 + 2, 6 + 3), and it is degenerate again; round 2 refills
    it once more, and the rounds are spent, so it stays."""
    calls = []

    def generate(positions, rnd):
        calls.append((tuple(int(p) for p in positions), rnd))
        return _chunk(positions, rnd)

    def scores(chunk):       # group 1 and round 1's refill of it (positions 8, 9) all equal
        g = chunk.prompt_index // 2
        return np.where(np.isin(g, [1, 4]), 1.0, chunk.prompt_index % 2).astype(float)

    done = sampling.refill(np.arange(6), generate, scores, samples=2, batch=6, rounds=2)
    assert calls == [((0, 1, 2, 3, 4, 5), 0), ((2, 3), 1), ((2, 3), 2)]
    assert sorted(done.chunk.prompt_index.tolist()) == [0, 1, 4, 5, 14, 15]
    assert (done.rounds, done.filtered, done.checked) == (2, 2, 4)     # 3 groups, then 1


def test_dynamic_sampling_stops_when_no_group_is_degenerate():
    done = sampling.refill(np.arange(4), lambda p, r: _chunk(p, r),
                           lambda c: (c.prompt_index % 2).astype(float), 2, 4, 3)
    assert (done.rounds, done.filtered) == (0, 0)
    assert done.chunk.prompt_index.tolist() == [0, 1, 2, 3]


def test_whole_groups_per_device():
    from rpeg.spec.model import LengthDist, Workload
    w = Workload(1, prompts=3, samples=2, prompt_len=4, gen_len=LengthDist.fixed(4))
    assert sampling.positions(0, 2, w, True).tolist() == [0, 1, 4, 5]
    assert sampling.positions(1, 2, w, True).tolist() == [2, 3]
    assert sampling.positions(1, 2, w, False).tolist() == [1, 3, 5]
