"""A generate stage's concurrency: ``max_num_seqs`` and ``kv_fraction`` are checked where written."""

from __future__ import annotations

import pytest

from rpeg.errors import SpecError
from rpeg.spec.parser import parse_text

SPEC = """pipeline k
workload {{ steps = 2; prompts = 4; samples = 2; prompt_len = 8; gen_len = 16 }}
model actor : tiny {{ optimizer = adam(lr = 1e-3) }}
model rm : tiny {{ head = reward; frozen; weights = "rm" }}
stage rollout = generate(actor, prompts, {kwargs}) -> responses, logprobs
stage scores = score(rm, responses) -> scores
stage adv = group_norm(scores) -> advantages
stage actor_step = train(actor, responses, advantages, logprobs, loss = grpo(0.2))
"""


def _lower(kwargs: str):
    from rpeg.spec.lower import lower_pipeline
    return lower_pipeline(parse_text(SPEC.format(kwargs=kwargs), "k.rpeg"))[0]


def test_the_knobs_are_stage_parameters():
    stage = _lower("max_num_seqs = 32, kv_fraction = 0.9").stage("rollout")
    assert stage.param("max_num_seqs") == 32 and stage.param("kv_fraction") == 0.9


@pytest.mark.parametrize("kwargs, message", [
    ("max_num_seqs = 0", "max_num_seqs must be at least 1, not 0"),
    ("max_num_seqs = 2.5", "max_num_seqs must be"),
    ("kv_fraction = 0", r"kv_fraction must be in \(0, 1\], not 0"),
    ("kv_fraction = 1.5", r"kv_fraction must be in \(0, 1\], not 1.5"),
])
def test_a_bad_knob_is_refused_at_its_place(kwargs, message):
    with pytest.raises(SpecError, match=message) as e:
        _lower(kwargs)
    assert e.value.span.line == 5          # the generate stage
