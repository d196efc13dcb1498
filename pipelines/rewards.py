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
    for response, answer in zip(responses, answers):
        found = _NUMBER.findall(response)
        out.append(1.0 if found and answer and found[-1] == answer.strip() else 0.0)
    return out


def toy_reward(prompts: list[str], responses: list[str], answers: list[str] | None = None
               ) -> list[float]:
    """The toy task (``data/toy.jsonl``): repeat a letter n times, then stop.

    Per response: the fraction of the n answer positions holding the right letter,
    scaled down when the response runs longer than n, plus 0.2 for stopping at
    exactly n. Range 0..1.2; a random byte-level policy scores about 0.
    """
    answers = answers or [""] * len(responses)
    out = []
    for response, answer in zip(responses, answers):
        n = max(len(answer), 1)
        hits = sum(1 for a, b in zip(response, answer) if a == b)
        score = hits / n * n / max(n, len(response))
        if response == answer:
            score += 0.2
        out.append(float(score))
    return out
