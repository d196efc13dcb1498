"""Dataset rows as the torch backend reads them: a row's prompt as token ids, and a kept
sample's row of ``samples.jsonl``.

    >>> sample_row(0, {"prompt": "1 + 1 =", "answer": "2"}, " 2", 1.0)
    {'index': 0, 'prompt': '1 + 1 =', 'response': ' 2', 'reward': 1.0, 'answer': '2'}
"""

from __future__ import annotations

import numpy as np

from rpeg.errors import BackendError


def row_prompt(codec, row: dict, workload) -> np.ndarray:
    """A dataset row's prompt as token ids, as the workload says (template, prompt_len,
    truncation); a row that breaks the contract stops the run naming its file and row, at
    the workload key it breaks, before anything is generated from it."""
    from backends.torch_backend.tokenizer import PromptTooLong
    from rpeg.errors import RuntimeFailure
    from rpeg.runtime.data import ROW
    where = "{}:{}".format(*row[ROW]) if ROW in row else "a dataset row"
    try:
        ids = codec.prompt(row["prompt"], workload.prompt_len, workload.template,
                           workload.truncation)
    except PromptTooLong as e:
        raise RuntimeFailure(f"{where}: the prompt is {e.tokens} tokens, and prompt_len is "
                             f"{e.max_len} (truncation = error)",
                             workload.span_of("prompt_len"),
                             hint="raise prompt_len, or set truncation = left (keep the end) "
                                  "or right (keep the start) in the workload") from None
    except BackendError as e:
        raise RuntimeFailure(f"{where}: {e.message}", workload.span_of("template"),
                             hint=e.hint) from None
    return np.asarray(ids, np.int64)


SAMPLE_CHARS = 4000             # a kept sample's prompt and response, each at most this long


def sample_row(index: int, row: dict, response: str, reward: float) -> dict:
    prompt = row["prompt"]
    prompt = prompt if isinstance(prompt, str) else prompt[-1]["content"]
    out = {"index": index, "prompt": prompt[-SAMPLE_CHARS:], "response": response[:SAMPLE_CHARS],
           "reward": reward}
    if "answer" in row:
        out["answer"] = str(row["answer"])[:SAMPLE_CHARS]
    return out
