"""What a decode step's sampling costs on this machine's CPU, measured on the engine's own
code path (``backends.torch_backend.generation.sample_at_least``).

    >>> rows = sampling_rows(repeats=1, calls=5)
    >>> sorted({(r["rows"], r["vocab"]) for r in rows}) == sorted(
    ...     (r, v) for r in ROWS for v in VOCABS)
    True

A torch engine on a CPU samples every live row's next token on the host each decode step:
the temperature-scaled log-softmax, its exponent, the draw (``torch.multinomial``) and the
token's log-probability, over the whole vocabulary. Its time is a fixed part per step (the
calls) and a part per logit (rows x vocabulary); at the tiny models' 259 tokens and a
batch of 64 it is ~0.45 ms a step, a tenth to a fifth of a generate op, which the model's
layers' terms do not price (a call per layer, elementwise bytes per hidden value). Timed on
a grid of rows and vocabularies (each point the median of ``repeats`` rounds of ``calls``
calls, thread CPU time, one thread), fitted as ``decode_overhead + rows x vocab x
sample_logit_time`` by ``rpeg.cost.calibrate.fit_sampling``.
"""

from __future__ import annotations

import statistics
import time

ROWS = (1, 8, 32, 64)
VOCABS = (259, 1024)


def sampling_rows(repeats: int = 5, calls: int = 100, temperature: float = 1.0,
                  top_p: float = 1.0) -> list[dict]:
    """Thread CPU seconds of one sampling call per (rows, vocab) point (run it where the
    ops run: one torch thread, the workers' allocator)."""
    import torch

    from backends.api import SamplingParams
    from backends.torch_backend.generation import generator, sample_at_least
    params = SamplingParams(max_new_tokens=1, temperature=temperature, top_p=top_p,
                            eos_id=0, seed=0)
    gen = generator("cpu", 0)
    out = []
    for vocab in VOCABS:
        for rows in ROWS:
            logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows))
            for _ in range(calls // 5 + 1):                    # warm up
                sample_at_least(logits, params, gen, 0, False)
            times = []
            for _ in range(repeats):
                t = time.thread_time()
                for _ in range(calls):
                    sample_at_least(logits, params, gen, 0, False)
                times.append((time.thread_time() - t) / calls)
            out.append({"rows": rows, "vocab": vocab, "seconds": statistics.median(times)})
    return out
