"""The eval block on a worker: the trained actor answers the held-out prompts.

    >>> result = evaluate(executor, "actor", step=10)            # doctest: +SKIP
    >>> result["reward"], result["pass@4"], result["accuracy"]    # doctest: +SKIP
    (0.41, 0.62, 0.41)

The replica is the actor's trained one (its weights after ``step`` updates, at a cut,
where nothing else runs on it). Prompts are rendered like the workload's (chat template
or raw text), each answered ``samples`` times at the eval's temperature (0: greedy),
in batches, with a seed of the step's own; the reward scores every response. A
verifier — a reward whose scores are all 0 or 1 — also gives the accuracy (the mean)
and pass@k (the prompts with a correct answer among their k = samples responses).
"""

from __future__ import annotations

import time

import attrs
import numpy as np

from backends.api import SamplingParams
from rpeg.errors import BackendError
from rpeg.runtime.data import answer_of
from rpeg.spec.model import OpKind

BATCH = 32                      # responses decoded together


def evaluate(ex, model: str, step: int) -> dict:
    from backends.torch_backend.rewards import Texts, score
    from backends.torch_backend.rows import row_prompt, sample_row
    from rpeg.runtime.data import eval_rows

    start = time.time()
    p = ex.ctx.pipeline
    e, w = p.evaluation, p.workload
    replica = ex.replicas.get(model)
    if replica is None or replica.engine is None:
        raise BackendError(f"eval must run on a whole trained replica of '{model}' with its "
                           "LM head, and this worker holds none (its trainer is sharded, or "
                           "it holds no LM head)", p.evaluation.span,
                           hint="plan it with rpeg compile's limits: they keep the evaluated "
                                "model's trainer at ZeRO 0 or 2 and tp = 1")
    if replica.sharded:
        raise BackendError(f"eval generates with one whole replica of '{model}', and its "
                           "trainer is split over tensor-parallel ranks",
                           p.evaluation.span, hint="plan the actor's training with tp = 1")
    if getattr(ex, "eval_rows", None) is None:
        ex.eval_rows = eval_rows(p)
    rows = [r for r in ex.eval_rows for _ in range(e.samples)]
    gen = next(s for s in p.stages if s.kind is OpKind.GENERATE)
    codec = ex._codec()
    prompts = [row_prompt(codec, r, w) for r in rows]
    params = SamplingParams(
        max_new_tokens=e.max_len or ex.works[gen.name].sampling.max_len,
        temperature=e.temperature, top_p=1.0, eos_id=codec.eos_id,
        seed=(w.seed * 1_000_003 + step) * 64 + 63)
    engine = replica.engine
    engine.version = replica.version
    responses: list[str] = [""] * len(prompts)
    lengths = [0] * len(prompts)
    from rpeg.spec.tools import conversation
    conv = conversation(gen, params.max_new_tokens)
    for lo in range(0, len(prompts), BATCH):
        batch = prompts[lo: lo + BATCH]
        # a stage with tools answers as it trains: conversations, with the same tools
        talk = {} if conv is None else {"tools": ex.toolbox(
            conv, codec, lambda _s, i, lo=lo: rows[lo + i], params.max_new_tokens)}
        for chunk in engine.generate(batch, attrs.evolve(params, seed=params.seed * 4096 + lo),
                                     chunks=1, **talk):
            for k, (i, ids) in enumerate(zip(chunk.prompt_index, chunk.response_ids,
                                             strict=True)):
                responses[lo + int(i)] = codec.decode(ids)
                # the policy's tokens, as training counts them: a conversation's observations
                # are the tools', not the answer's length
                lengths[lo + int(i)] = len(ids) if chunk.masks is None else \
                    int(np.sum(chunk.masks[k]))
    tokens = sum(lengths)
    texts = Texts(tuple(r["prompt"] for r in rows), tuple(responses),
                  tuple(answer_of(r) for r in rows), tuple(lengths),
                  int(params.max_new_tokens), tuple(rows), step)
    scores = score(p.reward(e.reward), texts)
    out = {"step": step, "version": replica.version, "prompts": len(ex.eval_rows),
           "samples": e.samples, "reward": float(scores.mean()),
           "response_len": tokens / max(len(responses), 1)}
    # accuracy: the share of answers scored in full (1 or more), at every evaluation alike
    # (a verifier's 0/1, a graded reward's perfect answers), so its curve has no gaps
    correct = scores.reshape(-1, e.samples) >= 1.0
    out["accuracy"] = float(correct.mean())
    out[f"pass@{e.samples}"] = float(correct.any(axis=1).mean())
    keep = p.log.samples
    out["kept"] = [sample_row(i, rows[i], responses[i], float(scores[i]))
                   for i in range(min(keep, len(rows)))]
    out["eval_s"] = time.time() - start
    return out

