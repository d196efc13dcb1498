"""Reward kinds: the user's python function, and DAPO's overlong shaping.

    >>> x = Texts(("p",) * 3, ("a", "bb", "ccc"), ("",) * 3, (4, 7, 8), budget=8)
    >>> overlong(Reward("long", "", "", kind="overlong", params=(("buffer", 4),)), x).tolist()
    [0.0, -0.75, -1.0]

Each kind takes the reward's declaration and the batch's texts and lengths and
returns one float32 score per response. A python reward is imported on first use,
in the worker, from the file the spec found it in (``rpeg.runtime.usercode.functions``), and called
``fn(prompts, responses, answers, **columns)``: the dataset's other columns reach it by
name (each one its parameters name, or all of them for ``**kwargs``); or, in verl's form
(``rpeg.spec.rewards``), ``compute_score(data_source=, solution_str=, ground_truth=,
extra_info=)`` once a response. Its scores are checked (``rpeg.runtime.usercode.rewards``).
"""

from __future__ import annotations

import inspect

import attrs
import numpy as np

from backends.torch_backend.algorithms import implementation, implements
from rpeg.runtime.data import ROW, reward_extras
from rpeg.runtime.usercode.functions import python_function
from rpeg.runtime.usercode.rewards import call_per_response, call_reward
from rpeg.spec.model import Reward
from rpeg.spec.training import RewardForm


@attrs.frozen
class Texts:
    """What a reward sees of a batch of responses."""

    prompts: tuple[str, ...]
    responses: tuple[str, ...]
    answers: tuple[str, ...]
    lengths: tuple[int, ...]          # response tokens
    budget: int = 0                   # the generate stage's max_len
    rows: tuple[dict, ...] = ()       # each response's dataset row (its other columns)
    step: int = 0                     # the step (for the errors a reward raises)


@implements("python")
def python(reward: Reward, x: Texts) -> tuple[np.ndarray, int]:
    fn = python_function(reward.module, reward.function, source=reward.source,
                         folder=reward.folder, what=f"reward '{reward.name}'",
                         span=reward.span if reward.span.line else None)
    params = inspect.signature(fn).parameters if callable(fn) else {}
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if reward.form is RewardForm.PER_RESPONSE:
        calls = [_per_response(params, takes_all, x, i) for i in range(len(x.responses))]
        return call_per_response(fn, reward, x.step, calls)
    extras = reward_extras(list(x.rows))
    if not takes_all:
        extras = {k: v for k, v in extras.items() if k in params}
    # a column named as one of the three lists rpeg passes (SQuAD's "answers") is not also
    # passed by name: the call would get two values for it (``rpeg check`` warns of it)
    own = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY,
                                                      p.POSITIONAL_OR_KEYWORD)][:3]
    extras = {k: v for k, v in extras.items() if k not in own}
    return call_reward(fn, reward, x.step, list(x.prompts), list(x.responses),
                       list(x.answers), extras)


def _per_response(params, takes_all: bool, x: Texts, i: int) -> dict:
    """verl's compute_score arguments for response ``i``: its text, its row's answer (as
    the dataset holds it) and columns, each passed when the function takes it."""
    row = x.rows[i] if i < len(x.rows) else {}
    given = {k: v for k, v in row.items() if k not in ("prompt", "answer", ROW)}
    given |= {"solution_str": x.responses[i], "ground_truth": row.get("answer", x.answers[i]),
              "prompt": x.prompts[i]}
    given.setdefault("data_source", None)
    given.setdefault("extra_info", None)
    return given if takes_all else {k: v for k, v in given.items() if k in params}


@implements("overlong")
def overlong(reward: Reward, x: Texts) -> np.ndarray:
    """0 up to ``max_len - buffer`` tokens, then linearly down to -1 at ``max_len``, -1 past."""
    args = dict(reward.params)
    top = int(args.get("max_len") or x.budget or max(x.lengths, default=1))
    band = int(args.get("buffer") or max(top // 4, 1))
    start = top - band
    lengths = np.asarray(x.lengths, np.float64)
    out = np.where(lengths <= start, 0.0, np.maximum((start - lengths) / band, -1.0))
    return out.astype(np.float32)


def score(reward: Reward, x: Texts) -> np.ndarray:
    """The reward's scores, by its kind's implementation."""
    return scored(reward, x)[0]


def scored(reward: Reward, x: Texts) -> tuple[np.ndarray, int]:
    """(the reward's scores, how many failed and scored 0 under ``on_error = zero``)."""
    out = implementation(reward.kind)(reward, x)
    return out if isinstance(out, tuple) else (out, 0)
