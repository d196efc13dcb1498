"""Reward kinds: the user's python function, and DAPO's overlong shaping.

    >>> x = Texts(("p",) * 3, ("a", "bb", "ccc"), ("",) * 3, (4, 7, 8), budget=8)
    >>> overlong(Reward("long", "", "", kind="overlong", params=(("buffer", 4),)), x).tolist()
    [0.0, -0.75, -1.0]

Each kind takes the reward's declaration and the batch's texts and lengths and
returns one float32 score per response. A python reward is imported on first use,
in the worker, from the module next to the spec (or on the Python path).
"""

from __future__ import annotations

import importlib

import attrs
import numpy as np

from backends.torch_backend.algorithms import implementation, implements
from rpeg.errors import BackendError
from rpeg.spec.model import Reward


@attrs.frozen
class Texts:
    """What a reward sees of a batch of responses."""

    prompts: tuple[str, ...]
    responses: tuple[str, ...]
    answers: tuple[str, ...]
    lengths: tuple[int, ...]          # response tokens
    budget: int = 0                   # the generate stage's max_len


_FUNCTIONS: dict[tuple[str, str], object] = {}


def _python_function(reward: Reward):
    key = (reward.module, reward.function)
    if key not in _FUNCTIONS:
        try:
            fn = getattr(importlib.import_module(reward.module), reward.function)
        except (ImportError, AttributeError) as e:
            raise BackendError(f"reward '{reward.name}' must name a function, and "
                               f"{reward.module}:{reward.function} is not one ({e})",
                               reward.span) from e
        _FUNCTIONS[key] = fn
    return _FUNCTIONS[key]


@implements("python")
def python(reward: Reward, x: Texts) -> np.ndarray:
    fn = _python_function(reward)
    return np.asarray(fn(list(x.prompts), list(x.responses), list(x.answers)), np.float32)


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
    return implementation(reward.kind)(reward, x)
