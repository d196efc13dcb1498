"""The contract between the runtime and a generation engine.

    >>> engine = load_engine("torch", model_cfg, device="cpu")      # doctest: +SKIP
    >>> for chunk in engine.generate(prompts, SamplingParams(max_new_tokens=32), chunks=2):
    ...     print(len(chunk), chunk.version)                         # doctest: +SKIP

Everything that crosses a process boundary is plain data (numpy arrays and
Python scalars), so Dask can move it between workers without pickling tensors.
A chunk holds responses that finished; downstream ops start on it while longer
responses are still being generated.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import attrs
import numpy as np


@attrs.frozen
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    eos_id: int | None = None
    seed: int = 0
    min_new_tokens: int = 0             # end-of-sequence is not sampled before this many tokens
    max_num_seqs: int = 0                  # sequences decoded at once (0: all; the torch engine
                                       # decodes in waves; vLLM's is set when it starts)


@attrs.frozen
class RolloutChunk:
    """Finished responses of one generate call, in prompt order within the chunk."""

    prompt_index: np.ndarray            # int64 [n]: index of each response's prompt in the step
    prompt_ids: tuple[np.ndarray, ...]  # int64 token ids of each prompt
    response_ids: tuple[np.ndarray, ...]  # int64 token ids generated (EOS included when reached)
    logprobs: tuple[np.ndarray, ...]    # float32 log-probability of each generated token
    finished: np.ndarray                # bool [n]: EOS reached (else cut at max_new_tokens)
    version: int                        # parameter version that generated the chunk
    temperature: float = 1.0            # the temperature its logprobs are at: the sampling
                                        # temperature (1 for greedy); every logprob computed
                                        # of these responses later uses it too

    def __len__(self) -> int:
        return len(self.response_ids)


@attrs.frozen
class Cohort:
    """The prompts of one step, given to an engine that carries responses over steps.

    Under partial rollouts (a plan's ``carry``) the generate op of step s also starts the
    responses of steps s + 1 .. s + carry; ``params`` is how this call samples the cohort
    (its seed differs per step, cohort and replica).
    """

    step: int
    prompt_ids: tuple[np.ndarray, ...]
    params: SamplingParams


class GenerationEngine(Protocol):
    """What a generate op needs of an engine (torch + transformers, or vLLM)."""

    version: int

    def generate(self, prompt_ids: list[np.ndarray], params: SamplingParams,
                 chunks: int = 1) -> Iterator[RolloutChunk]:
        """Sample one response per prompt; yield finished responses in ``chunks`` groups."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Load new parameters in place (bucketed by the caller); serve ``version`` after."""
        ...

    def shutdown(self) -> None:
        ...


@attrs.frozen
class CarriedResponse:
    """A response an engine started early under partial rollouts, as a checkpoint holds it."""

    cohort: int                        # the step whose prompts it answers
    index: int                         # its prompt's position in that step's share
    prompt: np.ndarray                 # int64
    tokens: np.ndarray                 # int64 tokens sampled so far
    logprobs: np.ndarray               # float32, each under the policy that sampled it
    versions: np.ndarray               # int64, that policy's parameter version per token
    ended: bool
    ended_at: int


@attrs.frozen
class CarriedState:
    """One generate op's partial-rollout buffer on one engine (``backends.carry``)."""

    key: str                           # the generate op
    step: int                          # the step it last served
    ends: int
    sampled: int
    responses: tuple[CarriedResponse, ...]
