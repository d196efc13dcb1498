"""Conversations with tools or an environment, token in, token out: shared by the engines.

    >>> box = Toolbox(sandbox, conversation, codec, row_of, max_len=32)   # doctest: +SKIP
    >>> for ended in converse(rows, engine_turn, box, eos):              # doctest: +SKIP
    ...     stream.add(ended)

A conversation is a :class:`backends.carry.Response` whose ``mask`` says which of its
tokens the policy sampled (1) and which an observation put there (0). It advances in
rounds: every live conversation's policy decodes one turn (the engine's ``decode``: to
end-of-sequence, a stop string of the format -- a call's closing tag -- or the turn's
budget), the turn's text is parsed for a tool call that ends it (read from the policy's
text since the last observation, or for a first turn since the prompt's end: a call the
prompt opened is completed by the turn), or with an environment is the action, the calls run in the sandbox together, and each observation -- the tool's text,
or ``error: ...`` -- is wrapped by the format, encoded once, cut to ``max_obs_len`` tokens
with a truncation marker, and appended. The policy's tokens are the engine's, never
decoded and encoded again; the next turn continues from the token ids so far. A turn's
tokens keep the logprob and the version of the policy that sampled them; an observation's
have version -1 and logprob 0, and are masked out of the loss, the KL and token counts.

A conversation ends when a turn has no call (or its environment says done), at
``max_turns``, or at ``max_total_len`` tokens after the prompt (``cut``). Between rounds a
conversation may pause (partial rollouts: the step's own conversations ended) and resume
in a later step under newer weights.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import attrs

from backends import tool_formats as F
from backends.carry import Response
from rpeg.runtime.usercode.sandbox import Counts


@attrs.define
class TurnStats:
    """What a generate op's conversations did (its statistics, the run's metrics)."""

    conversations: int = 0
    turns: int = 0
    obs_tokens: int = 0
    truncated: int = 0
    multi: int = 0                  # conversations of two or more turns

    def stats(self) -> dict:
        out = {"conversations": self.conversations, "turns": self.turns,
               "obs_tokens": self.obs_tokens, "obs_truncated": self.truncated,
               "multi_turn": self.multi}
        return out


class Toolbox:
    """What an engine needs to hold conversations: the sandbox, the stage's conversation
    (``rpeg.spec.tools.Conversation``), the model's codec, and the dataset row of each
    prompt (``row_of(step, index)``: an environment's reset reads it)."""

    def __init__(self, sandbox, conversation, codec, row_of: Callable[[int, int], dict],
                 max_len: int) -> None:
        self.sandbox = sandbox
        self.conv = conversation
        self.codec = codec
        self.row_of = row_of
        self.max_len = int(max_len)
        self.format = F.of(conversation.format)
        self.stop_strings = self.format.stops(conversation.tools)
        self.window = max((len(codec.encode(s)) for s in self.stop_strings), default=0) + 4
        self.marker = list(codec.encode(F.TRUNCATED))
        self.counts = TurnStats()
        self.calls = Counts()

    # --- what the engine asks while it decodes a turn ----------------------------------
    def budget(self, r: Response) -> int:
        """Tokens the current turn may take."""
        return max(min(self.max_len, self.conv.max_total_len - r.turn_start), 0)

    def stopped(self, r: Response) -> bool:
        """Whether the turn so far ends with one of the format's stop strings."""
        if not self.stop_strings:
            return False
        tail = self.codec.decode(r.tokens[max(r.turn_start, len(r.tokens) - self.window):],
                                 special=True)
        return tail.endswith(self.stop_strings)

    def take(self, r: Response, token: int, logprob: float, version: int, eos: int) -> bool:
        """Append one sampled token to ``r``'s turn; whether the turn ended with it."""
        r.tokens.append(int(token))
        r.logprobs.append(float(logprob))
        r.versions.append(int(version))
        r.mask.append(1)
        return token == eos or r.turn_len >= self.budget(r) or self.stopped(r)

    def stats(self) -> dict:
        """The statistics since the last call, and forget them."""
        out = {**self.counts.stats(), **self.calls.stats()}
        self.counts, self.calls = TurnStats(), Counts()
        return out

    # --- between turns ---------------------------------------------------------------------
    def observe(self, r: Response, text: str, ended_at_eos: bool) -> bool:
        """Append an observation to ``r`` (wrapped, cut to its caps); whether there is room
        for another turn after it."""
        head, tail = self.format.wrap(text, ended_at_eos)
        # the format's wrapper is markup (its special tokens are tokens); the tool's text is
        # data: a special token's name in it stays characters
        body = list(self.codec.encode_plain(text))
        if len(body) > self.conv.max_obs_len:
            keep = max(self.conv.max_obs_len - len(self.marker), 0)
            body = body[:keep] + self.marker[:self.conv.max_obs_len - keep]
            self.counts.truncated += 1
        ids = list(self.codec.encode(head)) + body + list(self.codec.encode(tail))
        room = self.conv.max_total_len - len(r.tokens)
        ids = ids[:max(room, 0)]
        r.tokens += ids
        r.logprobs += [0.0] * len(ids)
        r.versions += [-1] * len(ids)
        r.mask += [0] * len(ids)
        self.counts.obs_tokens += len(ids)
        return self.conv.max_total_len - len(r.tokens) > 0

    def open(self, rows: list[Response]) -> list[Response]:
        """Each new conversation with an environment: its environment started (reset on the
        prompt and its dataset row); reset's text, if any, is the first observation. The
        conversations whose environment failed to start (an error, its timeout) end there,
        with the error as their observation: those are returned."""
        fresh = [r for r in rows if r.mask is not None and not r.tokens and r.handle < 0]
        if not fresh or self.conv.environment is None:
            return []
        opens = []
        for r in fresh:
            row = self.row_of(r.cohort, r.index)
            prompt = row.get("prompt", "")
            opens.append((self.conv.environment, prompt if isinstance(prompt, str)
                          else json.dumps(prompt), row))
        failed = []
        for r, o in zip(fresh, self.sandbox.open_many(opens), strict=True):
            if not o.ok:                # a failed start is a sandbox call that failed
                self.calls.add(o)
                self.observe(r, F.observation_text(self.conv.format, False, "", o.error),
                             True)
                _end(r, cut=False)
                failed.append(r)
                continue
            r.handle = o.handle
            if o.text:
                self.observe(r, o.text, True)
        return failed


def _end(r: Response, cut: bool) -> None:
    r.ended = True
    r.cut = cut


def start(r: Response) -> None:
    """Make ``r`` a conversation (its tokens so far, if any, the policy's)."""
    if r.mask is None:
        r.mask = [1] * len(r.tokens)


def converse(rows: list[Response], decode: Callable[[list[Response]], None], box: Toolbox,
             eos: int, until: Callable[[], bool] | None = None) -> Iterator[list[Response]]:
    """Advance the conversations ``rows`` a round at a time (see the module doc); after each
    round, yield those that ended in it. Stops when all ended, or when ``until()`` says so
    (the others then pause between turns)."""
    for r in rows:
        start(r)
    failed = box.open(rows)
    lost = [r for r in rows if box.conv.environment is not None and r.handle < 0
            and r.tokens and not r.ended]
    for r in lost:                  # resumed: its environment's process is gone
        box.observe(r, F.observation_text(box.conv.format, False, "", "the environment was "
                                          "lost when the run stopped"), True)
        _end(r, cut=True)
    if failed or lost:              # ended before their first turn
        _count(box, failed + lost)
        yield failed + lost
    while True:
        live = [r for r in rows if not r.ended]
        if not live:
            return
        for r in live:
            r.turn_start = len(r.tokens)
        decode([r for r in live if box.budget(r) > 0])
        ended = _after_turn(live, box, eos)
        _count(box, ended)
        yield ended
        if until is not None and until():
            return


def _after_turn(live: list[Response], box: Toolbox, eos: int) -> list[Response]:
    """Each conversation's turn done: run the calls (or environment steps), append the
    observations; the conversations that ended."""
    conv = box.conv
    calls, steps = [], []
    for r in live:
        r.turns += 1
        turn = r.tokens[r.turn_start:]
        at_eos = bool(turn) and turn[-1] == eos
        room = conv.max_total_len - len(r.tokens)
        if conv.environment is not None:
            if r.handle >= 0 and turn:
                action = box.codec.decode(turn[:-1] if at_eos else turn)
                steps.append((r, action, at_eos))
            else:
                _end(r, cut=not at_eos)
            continue
        call = _call_in(r, box, at_eos) if turn else None
        if call is not None and r.turns < conv.max_turns and room > 0:
            calls.append((r, call, at_eos))
        else:
            _end(r, cut=call is not None or not (at_eos or box.stopped(r)))
    if calls:
        outcomes = box.sandbox.call_many([(c.name, c.arg) for _, c, _ in calls])
        for (r, _, at_eos), o in zip(calls, outcomes, strict=True):
            box.calls.add(o)
            if not box.observe(r, F.observation_text(conv.format, o.ok, o.text, o.error),
                               at_eos):
                _end(r, cut=True)
    if steps:
        outcomes = box.sandbox.step_many([(r.handle, a) for r, a, _ in steps])
        closing = []
        for (r, _, at_eos), o in zip(steps, outcomes, strict=True):
            box.calls.add(o)
            room = box.observe(r, F.observation_text(conv.format, o.ok, o.text, o.error),
                               at_eos)
            if o.done or not room or r.turns >= conv.max_turns:
                _end(r, cut=not o.done)
                closing.append(r.handle)
        box.sandbox.close_many(closing)
    return [r for r in live if r.ended]


PREFILL = 256       # prompt tokens a first turn's call may have started in


def _call_in(r: Response, box: Toolbox, at_eos: bool):
    """The call the current turn makes: read from the policy's own text back to the last
    observation; failing that, on a first turn, with the prompt's end before it, so a call
    the prompt opened (an assistant prefill) is completed by the turn. Never from the
    prompt alone: an example call in a system message is not the policy's."""
    own, head = _since_observation(r)
    cut = -1 if at_eos else None
    tools, text = box.conv.tools, (lambda ids: box.codec.decode(ids, special=True))
    call = box.format.parse(text(own[:cut]), tools)
    if call is None and head:
        call = box.format.parse(text((head + own)[:cut]), tools)
    return call


def _since_observation(r: Response) -> tuple[list[int], list[int]]:
    """(the policy's text back to the last observation, the prompt's last PREFILL tokens
    where that reaches the prompt: a first turn)."""
    start = r.turn_start
    while start > 0 and r.mask[start - 1] == 1:
        start -= 1
    head = [int(t) for t in r.prompt[-PREFILL:]] if start == 0 else []
    return list(r.tokens[start:]), head


def _count(box: Toolbox, ended: list[Response]) -> None:
    for r in ended:
        box.counts.conversations += 1
        box.counts.turns += r.turns
        box.counts.multi += 1 if r.turns >= 2 else 0


def turns_of(response_ids, mask, versions, decode, observer: str = "tool",
             chars: int = 4000) -> list[dict]:
    """A conversation as ``samples.jsonl`` keeps it: its turns in order, each ``who`` (policy,
    or the tool or environment), its text, token count and -- the policy's -- the version
    of the weights that sampled it."""
    out: list[dict] = []
    start = 0
    n = len(mask)
    while start < n:
        end = start
        while end < n and mask[end] == mask[start]:
            end += 1
        turn = {"who": "policy" if mask[start] else observer,
                "text": decode(response_ids[start:end])[:chars], "tokens": end - start}
        if mask[start]:
            seen = sorted({int(v) for v in versions[start:end]})
            turn["version"] = seen[0]
            if len(seen) > 1:
                turn["versions"] = seen
        out.append(turn)
        start = end
    return out


__all__ = ["Toolbox", "TurnStats", "converse", "start", "turns_of"]
