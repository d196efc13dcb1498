"""Calling a user's reward function, and refusing what it returns unless it is one finite
number per response.

    >>> reward = Reward("toy", "rewards", "toy_reward")
    >>> check_scores([0.5, 1.0], 2, reward, step=3).tolist()
    [0.5, 1.0]
    >>> check_scores([0.5, float("nan")], 2, reward, step=3)
    Traceback (most recent call last):
    ...
    rpeg.errors.RuntimeFailure: error: reward 'toy' (rewards:toy_reward) must return a finite number for every response, not nan (response 1 of the 2 it scored, step 3)

A ``python("module:function")`` reward is the user's code, called inside a worker with
the step's prompts, decoded responses and reference answers. What it returns goes into
the advantages and from there into the weights, so it is checked before anything reads
it: a sequence of exactly one number per response, each finite. Anything else stops the
run at that step with a :class:`RuntimeFailure` naming the reward (at its line in the
spec), the step and what was wrong: no NaN reaches an update, a checkpoint or
metrics.jsonl. An exception raised inside the reward is reported the same way, with the
user's own frames (file and line, the source line and a caret) as notes, from the
reward function inward.
"""

from __future__ import annotations

import numbers
import traceback

import numpy as np

from rpeg.errors import RuntimeFailure, Span
from rpeg.spec.model import Reward

MAX_FRAMES = 8           # of the user's traceback, innermost last


# what a reward's code raises that is the reward's failure: any exception, and sys.exit()
# (which would otherwise end the worker's process, and be taken for a lost worker)
USER_ERRORS = (Exception, SystemExit)


def call_reward(fn, reward: Reward, step: int, prompts: list[str], responses: list[str],
                answers: list[str], extras: dict | None = None) -> tuple[np.ndarray, int]:
    """``fn(prompts, responses, answers, **extras)`` checked: (float32 scores, one per
    response; how many failed and scored 0) -- ``extras``: the dataset's other columns, by
    name. A failure (an exception, a score that is not finite) stops the run, or under
    ``on_error = zero`` scores 0: every response for an exception, that one for a score."""
    try:
        value = fn(prompts, responses, answers, **(extras or {}))
    except USER_ERRORS as e:  # the user's code: any exception is theirs to see
        if reward.on_error == "zero":
            return np.zeros(len(responses), np.float32), len(responses)
        raise _raised(e, reward, step) from None
    return _zeroed(value, len(responses), reward, step)


def call_per_response(fn, reward: Reward, step: int, calls: list[dict]) -> tuple[np.ndarray,
                                                                                   int]:
    """verl's form: ``fn(**kwargs)`` once a response, each returning a number or a dict with
    its ``score``; (float32 scores, how many failed and scored 0), as :func:`call_reward`."""
    values, failed = [], 0
    for kwargs in calls:
        try:
            value = fn(**kwargs)
        except USER_ERRORS as e:  # the user's code
            if reward.on_error != "zero":
                raise _raised(e, reward, step) from None
            value, failed = 0.0, failed + 1
        if isinstance(value, dict) and "score" in value:
            value = value["score"]
        values.append(value)
    scores, bad = _zeroed(values, len(calls), reward, step)
    return scores, failed + bad


def _zeroed(value, n: int, reward: Reward, step: int) -> tuple[np.ndarray, int]:
    """``check_scores``, except that under ``on_error = zero`` a score that is not finite
    becomes 0 (and is counted)."""
    if reward.on_error != "zero" or not isinstance(value, (list, tuple, np.ndarray)):
        return check_scores(value, n, reward, step), 0
    items = list(np.asarray(value).reshape(-1)) if isinstance(value, np.ndarray) else \
        list(value)
    bad = [i for i, x in enumerate(items) if isinstance(x, (numbers.Real, np.number))
           and not np.isfinite(float(x))]
    for i in bad:
        items[i] = 0.0
    return check_scores(items, n, reward, step), len(bad)


def check_scores(value, n: int, reward: Reward, step: int) -> np.ndarray:
    """``value`` as ``n`` float32 scores, or a RuntimeFailure saying what is wrong with it."""
    if isinstance(value, np.ndarray):
        items = list(value.reshape(-1)) if value.ndim == 1 else None
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        items = None
    if items is None:
        shape = f"an array of shape {value.shape}" if isinstance(value, np.ndarray) \
            else _kind(value)
        raise _wrong(reward, step, f"a list of {n} numbers (one per response), not {shape}")
    if len(items) != n:
        raise _wrong(reward, step, f"{n} scores (one per response), not {len(items)}")
    top = float(np.finfo(np.float32).max)
    for i, x in enumerate(items):
        at = f"response {i} of the {n} it scored"
        if not isinstance(x, (numbers.Real, np.number, np.bool_)):
            raise _wrong(reward, step, f"a number for every response, not {_kind(x)}", at)
        if not np.isfinite(float(x)):
            raise _wrong(reward, step, f"a finite number for every response, not {float(x)}",
                         at)
        if abs(float(x)) > top:
            raise _wrong(reward, step, f"a number float32 holds for every response, not "
                                       f"{float(x)!r}", at)
    return np.asarray([float(x) for x in items], dtype=np.float32)


def _wrong(reward: Reward, step: int, what: str, at: str = "") -> RuntimeFailure:
    where = f"{at}, step {step}" if at else f"step {step}"
    return RuntimeFailure(f"reward '{reward.name}' ({reward.module}:{reward.function}) must "
                          f"return {what} ({where})", _span(reward),
                          hint="fix the reward function; the run stopped before any update "
                               "used these scores")


def _raised(e: BaseException, reward: Reward, step: int) -> RuntimeFailure:
    """The user's exception, with their frames (below this module's call) as notes."""
    frames = traceback.extract_tb(e.__traceback__)[1:][-MAX_FRAMES:]
    notes = [(f"in {f.name}" + (f": {type(e).__name__} raised here" if i == len(frames) - 1
                                 else ""),
              Span(f.filename, f.lineno or 0, (f.colno or 0) + 1,
                   f.end_lineno or 0, (f.end_colno or 0) + 1))
             for i, f in enumerate(frames)]
    text = str(e)
    hint = ("the reward's own frames are above, innermost last" if notes else
            "the reward could not be called with what rpeg passes (prompts, responses, "
            "answers, and columns by name; or verl's data_source, solution_str, "
            "ground_truth, extra_info): see rpeg help functions python")
    return RuntimeFailure(f"reward '{reward.name}' ({reward.module}:{reward.function}) raised "
                          f"{type(e).__name__} at step {step}" + (f": {text}" if text else ""),
                          _span(reward), notes=notes,
                          hint=hint + "; the run stopped before any update used this step's "
                                      "scores (on_error = zero scores a failure 0 instead)")


def _span(reward: Reward) -> Span | None:
    return reward.span if reward.span.line else None


def _kind(x) -> str:
    if x is None:
        return "None"
    if isinstance(x, str):
        return f"the string {x[:40]!r}"
    return f"a {type(x).__name__}"
