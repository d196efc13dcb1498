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



def final_answer(prompts: list[str], responses: list[str], answers: list[str] | None = None
                 ) -> list[float]:
    """``exact_match`` on what the policy wrote after the last tool result of its
    conversation (``</tool_response>`` or ``</result>``): a number the tool printed is not
    the policy's answer until it says it."""
    last = []
    for response in responses:
        cut = max(response.rfind("</tool_response>"), response.rfind("</result>"))
        last.append(response[cut:].split(">", 1)[-1] if cut >= 0 else response)
    return exact_match(prompts, last, answers)


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
    """The tool task (``data/keys.jsonl``): each prompt opens a call of the lookup tool on a
    key; the policy must end the call to get the key's value, then answer with it. A
    response is the whole conversation: the policy's turns and the observations
    (``<result>...</result>``) between them.

    0 unless the last observation is a value (not an error: the call held the key and
    nothing else) and the policy answered after it (an empty answer, the policy stopping at
    once, is no answer: a policy that learned to close the call must still learn to
    speak); then 0.2, plus 0.8 x (0.3 x the share of lowercase letters in the text
    after it, + 0.7 x the share of the value's letters it has in place), over at least the
    value's length (extra text costs). Without the tool there is no observation and the
    reward is 0; a policy that calls the tool but ignores its result scores at most
    ``guess_ceiling`` of the values (its best fixed answer); answering with the tool's
    result scores 1.
    """
    answers = answers or [""] * len(responses)
    out = []
    for response, value in zip(responses, answers, strict=False):
        if "</result>" not in response:
            out.append(0.0)
            continue
        end = response.rindex("</result>")
        result = response[response.rfind("<result>", 0, end) + len("<result>"):end]
        text = response[end + len("</result>"):]
        n = max(len(text), len(value), 1)
        lower = sum("a" <= c <= "z" for c in text) / n
        hits = sum(a == b for a, b in zip(text, value, strict=False)) / n
        if result.startswith("error") or not text.strip():    # no value, or no answer
            out.append(0.0)
            continue
        out.append(0.2 + 0.8 * (0.3 * lower + 0.7 * hits))
    return out


def guess_ceiling(answers: list[str]) -> float:
    """The most ``lookup_reward`` gives, in expectation over ``answers``, a policy that
    calls the tool but does not read its result: 0.2, plus 0.8 x (0.3 for lowercase
    letters, + 0.7 x the best fixed answer's expected share of letters in place: the
    commonest letter at each position)."""
    from collections import Counter
    n = max(len(a) for a in answers)
    share = sum(Counter(a[i] for a in answers if len(a) > i).most_common(1)[0][1] / len(answers)
                for i in range(n)) / n
    return 0.2 + 0.8 * (0.3 + 0.7 * share)
