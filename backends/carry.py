"""Partial rollouts' buffer, shared by the generation engines (torch and vLLM).

    >>> import numpy as np
    >>> from backends.api import Cohort, SamplingParams
    >>> carried: dict[str, Carried] = {}
    >>> params = SamplingParams(max_new_tokens=4, eos_id=258)
    >>> cohorts = [Cohort(s, (np.array([257, 97]),) * 2, params) for s in (0, 1)]
    >>> buf, own = admit(carried, "rollout", cohorts)
    >>> [r.cohort for r in own], sorted(buf.cohorts)        # step 0's; step 1's kept
    ([0, 0], [1])
    >>> record(own[0], token=258, logprob=-0.5, version=0, max_new=4, eos=258)
    True
    >>> states = export(carried)                             # what a checkpoint holds
    >>> restore(states)["rollout"].cohorts[1][0].prompt.tolist()
    [257, 97]

Under a plan's ``carry`` the generate op of step s outputs the responses to step s's
prompts, and the engine also starts the responses of the next ``carry`` steps early and
keeps them between calls (a *cohort* per step). A response keeps its tokens, the
logprob of each under the policy that sampled it and that policy's version; a chunk's
``version`` is the oldest version among its tokens. An engine continues a carried
response from its prompt and the tokens it has, under the weights it serves now.

The buffer is checkpointed as :class:`backends.api.CarriedState` values (:func:`export`,
:func:`restore`), so a resumed run continues the same responses. A call for any step but
the one after the buffer's last starts afresh (a replaced worker with no checkpoint), and
a kept cohort whose prompts differ from the call's (a re-planned run dealing prompts to
other devices) is dropped and admitted anew.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import numpy as np

from backends.api import CarriedResponse, CarriedState, Cohort, RolloutChunk, chunk_bounds


@attrs.define(eq=False)
class Response:
    """One response of a cohort, kept between steps until its step streams it."""

    cohort: int                       # the step whose prompts it answers
    index: int                        # its prompt's position in the cohort
    prompt: np.ndarray
    tokens: list[int] = attrs.Factory(list)
    logprobs: list[float] = attrs.Factory(list)   # each under the policy that sampled it
    versions: list[int] = attrs.Factory(list)     # the version of that policy, per token
    ended: bool = False               # reached EOS or the length cap
    ended_at: int = -1                # when, in the order responses ended (across steps)
    # a conversation's (backends.turns): its tokens' mask (1 policy, 0 observation), policy
    # turns, where the current turn started, its environment, whether a cap ended it
    mask: list[int] | None = None
    turns: int = 0
    turn_start: int = 0
    handle: int = -1
    cut: bool = False

    @property
    def turn_len(self) -> int:
        """Tokens of the current turn."""
        return len(self.tokens) - self.turn_start

    @property
    def oldest(self) -> int:
        """The oldest parameter version among its policy's tokens (-1: none yet; an
        observation's tokens have none)."""
        sampled = [v for v in self.versions if v >= 0]
        return min(sampled) if sampled else -1

    def context(self) -> np.ndarray:
        """Prompt and the tokens so far: what an engine continues it from."""
        return np.concatenate([self.prompt, np.asarray(self.tokens, dtype=np.int64)])


@attrs.define
class Carried:
    """What one generate op keeps on a replica between steps under partial rollouts."""

    step: int = -1                    # the step it last served
    cohorts: dict[int, list[Response]] = attrs.Factory(dict)   # later steps' responses
    ends: int = 0                     # responses ended so far (orders ``ended_at``)
    sampled: int = 0                  # tokens sampled so far
    budgets: dict[int, int] = attrs.Factory(dict)   # this call's token budget per cohort


def admit(carried: dict[str, Carried], key: str,
          cohorts: list[Cohort]) -> tuple[Carried, list[Response]]:
    """The buffer ``key`` for a call on ``cohorts`` (``cohorts[0]`` is this step's), with
    every cohort it lacks admitted; returns it and this step's responses, taken out of it."""
    now = cohorts[0].step
    buf = carried.get(key)
    if buf is None or buf.step != now - 1:          # first step, or resumed without a buffer
        buf = carried[key] = Carried()
    buf.step = now
    buf.budgets = {c.step: c.budget for c in cohorts if c.budget > 0}
    for c in [c for c in buf.cohorts if c < now]:
        del buf.cohorts[c]
    for c in cohorts:
        kept = buf.cohorts.get(c.step)
        if kept is not None and not _same_prompts(kept, c):
            kept = None                             # dealt differently: start it again
        if kept is None:
            buf.cohorts[c.step] = [Response(c.step, i, np.asarray(p, dtype=np.int64))
                                   for i, p in enumerate(c.prompt_ids)]
    return buf, buf.cohorts.pop(now)


def _same_prompts(kept: list[Response], cohort: Cohort) -> bool:
    return len(kept) == len(cohort.prompt_ids) and all(
        np.array_equal(r.prompt, np.asarray(p)) for r, p in zip(kept, cohort.prompt_ids,
                                                                 strict=True))


def live(own: list[Response], buf: Carried) -> list[Response]:
    """The responses a call decodes: this step's unfinished ones, then the later cohorts'
    that have not used their budget."""
    return [r for r in own if not r.ended] + [
        r for c in sorted(buf.cohorts) for r in buf.cohorts[c]
        if not r.ended and not paused(buf, r)]


def paused(buf: Carried, r: Response) -> bool:
    """Whether ``r``, of a cohort started early, has the tokens its cohort's budget allows
    in this call (``Cohort.budget``): it leaves the batch unfinished, for the next call.

        >>> from backends.api import SamplingParams
        >>> params = SamplingParams(max_new_tokens=4, eos_id=258)
        >>> buf, own = admit({}, "g", [Cohort(0, (np.array([97]),), params),
        ...                            Cohort(1, (np.array([97]),), params, budget=2)])
        >>> later = buf.cohorts[1][0]
        >>> record(later, token=97, logprob=-1.0, version=0, max_new=4, eos=258)
        False
        >>> paused(buf, later), len(live(own, buf))
        (False, 2)
        >>> record(later, token=97, logprob=-1.0, version=0, max_new=4, eos=258)
        False
        >>> paused(buf, later), len(live(own, buf))
        (True, 1)
    """
    budget = buf.budgets.get(r.cohort, 0)
    return budget > 0 and not r.ended and len(r.tokens) >= budget


def record(r: Response, token: int, logprob: float, version: int, max_new: int,
           eos: int | None) -> bool:
    """Append one sampled token to ``r``; whether the response ended with it."""
    r.tokens.append(int(token))
    r.logprobs.append(float(logprob))
    r.versions.append(int(version))
    if (eos is not None and eos >= 0 and token == eos) or len(r.tokens) >= max_new:
        r.ended = True
    return r.ended


def mark_ended(buf: Carried, ended: list[Response]) -> None:
    """Number the responses that just ended, in the order they ended."""
    for r in ended:
        r.ended_at, buf.ends = buf.ends, buf.ends + 1


class Stream:
    """This step's responses (``own``), streamed in ``chunks`` groups as they end: those
    that ended in earlier steps first, in the order they ended."""

    def __init__(self, own: list[Response], chunks: int, eos: int | None) -> None:
        self.step = own[0].cohort if own else -1
        self.bounds = chunk_bounds(len(own), chunks)
        self.done = sorted((r for r in own if r.ended), key=lambda r: r.ended_at)
        self.emitted = 0
        self.eos = eos

    @property
    def complete(self) -> bool:
        return self.emitted == len(self.bounds)

    def add(self, ended: list[Response]) -> None:
        self.done += [r for r in ended if r.cohort == self.step]

    def ready(self) -> Iterator[RolloutChunk]:
        """The chunks whose responses have all ended, not yielded before."""
        while not self.complete and len(self.done) >= self.bounds[self.emitted][1]:
            yield chunk(self.done[slice(*self.bounds[self.emitted])], self.eos)
            self.emitted += 1


def chunk(done: list[Response], eos: int | None) -> RolloutChunk:
    """Finished responses of one cohort, in prompt order; its version is the oldest any of
    their tokens was sampled with."""
    rs = sorted(done, key=lambda r: r.index)
    conversations = any(r.mask is not None for r in rs)
    return RolloutChunk(
        prompt_index=np.asarray([r.index for r in rs], dtype=np.int64),
        prompt_ids=tuple(r.prompt for r in rs),
        response_ids=tuple(np.asarray(r.tokens, dtype=np.int64) for r in rs),
        logprobs=tuple(np.asarray(r.logprobs, dtype=np.float32) for r in rs),
        finished=np.asarray([not r.cut if r.mask is not None else
                             eos is not None and eos >= 0 and r.tokens[-1] == eos
                             for r in rs], dtype=bool),
        version=min(r.oldest for r in rs),
        versions=tuple(np.asarray(r.versions, dtype=np.int64) for r in rs),
        masks=tuple(np.asarray(r.mask if r.mask is not None else [1] * len(r.tokens),
                               dtype=np.uint8) for r in rs) if conversations else None,
    )


# --- checkpoints -------------------------------------------------------------------------

def export(carried: dict[str, Carried]) -> tuple[CarriedState, ...]:
    """Every buffer as plain values (numpy arrays and scalars), for a checkpoint."""
    return tuple(
        CarriedState(key=key, step=buf.step, ends=buf.ends, sampled=buf.sampled,
                     responses=tuple(_response_value(r) for c in sorted(buf.cohorts)
                                     for r in buf.cohorts[c]))
        for key, buf in sorted(carried.items()))


def restore(states) -> dict[str, Carried]:
    """The buffers :func:`export` wrote."""
    out: dict[str, Carried] = {}
    for s in states:
        buf = Carried(step=int(s.step), ends=int(s.ends), sampled=int(s.sampled))
        for v in s.responses:
            buf.cohorts.setdefault(int(v.cohort), []).append(Response(
                int(v.cohort), int(v.index), np.asarray(v.prompt, dtype=np.int64),
                [int(x) for x in v.tokens], [float(x) for x in v.logprobs],
                [int(x) for x in v.versions], bool(v.ended), int(v.ended_at),
                mask=None if v.mask is None else [int(x) for x in v.mask],
                turns=int(v.turns), turn_start=int(v.turn_start), cut=bool(v.cut)))
        for rs in buf.cohorts.values():
            rs.sort(key=lambda r: r.index)
        out[str(s.key)] = buf
    return out


def _response_value(r: Response) -> CarriedResponse:
    return CarriedResponse(cohort=r.cohort, index=r.index, prompt=np.asarray(r.prompt, np.int64),
                           tokens=np.asarray(r.tokens, dtype=np.int64),
                           logprobs=np.asarray(r.logprobs, dtype=np.float32),
                           versions=np.asarray(r.versions, dtype=np.int64),
                           ended=r.ended, ended_at=r.ended_at,
                           mask=None if r.mask is None else np.asarray(r.mask, np.uint8),
                           turns=r.turns, turn_start=r.turn_start, cut=r.cut)
