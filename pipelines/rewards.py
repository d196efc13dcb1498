"""Rule-based rewards the shipped pipelines name with ``python("rewards:NAME")``.

A reward function takes the decoded prompt and response texts of a batch and
returns one float per response.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def exact_match(prompts: list[str], responses: list[str], answers: list[str] | None = None
                ) -> list[float]:
    """1.0 when the last number in the response equals the reference answer, else 0.0."""
    answers = answers or [""] * len(responses)
    out = []
    for response, answer in zip(responses, answers, strict=False):
        found = _NUMBER.findall(response)
        out.append(1.0 if found and answer and found[-1] == answer.strip() else 0.0)
    return out



def toy_reward(prompts: list[str], responses: list[str], answers: list[str] | None = None
               ) -> list[float]:
    """The toy task (``data/toy.jsonl``): repeat a letter n times, then stop.

    Three parts with partial credit, so a randomly initialised byte-level model has
    a gradient to climb: 0.2 x the fraction of lowercase letters in the response,
    0.5 x the fraction of the n answer positions holding the right letter, and
    0.3 x how close the length is to n. Range 0..1; a random policy scores ~0.15.
    """
    answers = answers or [""] * len(responses)
    out = []
    for response, answer in zip(responses, answers, strict=False):
        n = max(len(answer), 1)
        lower = sum(1 for ch in response if "a" <= ch <= "z") / max(len(response), 1)
        hits = sum(1 for a, b in zip(response, answer, strict=False) if a == b) / n
        length = max(0.0, 1.0 - abs(len(response) - n) / TOY_MAX_LEN)
        out.append(0.2 * lower + 0.5 * hits + 0.3 * length)
    return out


TOY_MAX_LEN = 20        # the tiny pipelines' max_len


def lookup_reward(prompts: list[str], responses: list[str], answers: list[str] | None = None
                  ) -> list[float]:
    """The tool task (``data/keys.jsonl``): call the lookup tool with the prompt's key, then
    answer with the value it returned. A response is the whole conversation: the policy's
    turns and the observations (``<result>...</result>``) between them.

    0.2 x how much of the call ``<k>KEY</k>`` the response starts with (the common prefix's
    share: a gradient towards the call, one character at a time), plus, only after an
    observation, 0.8 x how much of the value the text after the last observation starts
    with, over at least the value's length (extra text costs). Without a call there is no
    observation, so the most a policy that never calls the tool scores is 0.2 x 9/10 = 0.18
    (a call one character short); answering right after the tool's result scores 1.
    """
    answers = answers or [""] * len(responses)
    out = []
    for key, response, value in zip(prompts, responses, answers, strict=False):
        call = f"<k>{key.strip()}</k>"
        credit = _common_prefix(response, call) / len(call)
        answer = 0.0
        if "</result>" in response:
            text = response[response.rindex("</result>") + len("</result>"):]
            answer = _common_prefix(text, value) / max(len(text), len(value), 1)
        out.append(0.2 * credit + 0.8 * answer)
    return out


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


LOOKUP_NO_TOOL_CEILING = 0.2 * 9 / 10     # see lookup_reward
