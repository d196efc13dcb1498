"""The contracts between the runtime and a backend: a device's op runner, a generation
engine, and an engine that serves a model's copy of its own.

    >>> engine = load_engine("torch", model_cfg, device="cpu")      # doctest: +SKIP
    >>> for chunk in engine.generate(prompts, SamplingParams(max_new_tokens=32), chunks=2):
    ...     print(len(chunk), chunk.version)                         # doctest: +SKIP

Everything that crosses a process boundary is plain data (numpy arrays and
Python scalars), so Dask can move it between workers without pickling tensors.
A chunk holds responses that finished; downstream ops start on it while longer
responses are still being generated.

The runtime holds one :class:`Executor` per device (``backends.load(name, "executor")``,
built as ``Executor(ctx, device)`` once per worker); the torch backend's runs every op, and
for a generate stage the plan gives an engine of its own it holds that generation backend's
:class:`EngineCopy` (vLLM's ``EngineReplica``) among its replicas.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

import attrs
import numpy as np

from rpeg.errors import BackendError


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
    # per response token: the version of the policy that sampled it (-1: an observation)
    versions: tuple[np.ndarray, ...] | None = None
    # a conversation's (tools, an environment): 1 for the policy's tokens, 0 for the
    # observations' -- out of the loss, the KL and token counts. None: all the policy's
    masks: tuple[np.ndarray, ...] | None = None
    temperature: float = 1.0            # the temperature its logprobs are at: the sampling
                                        # temperature (1 for greedy); every logprob computed
                                        # of these responses later uses it too

    def __len__(self) -> int:
        return len(self.response_ids)

    def policy_tokens(self) -> int:
        """Tokens the policy sampled (observations left out)."""
        if self.masks is None:
            return int(sum(len(r) for r in self.response_ids))
        return int(sum(int(np.sum(m)) for m in self.masks))


def _opt(parts, field: str) -> tuple | None:
    """An optional per-response field of ``parts`` concatenated; None when none has it. A
    part without it gets its default: every token its chunk's version, or the policy's."""
    if all(getattr(p, field) is None for p in parts):
        return None
    out = []
    for p in parts:
        have = getattr(p, field)
        if have is not None:
            out += list(have)
        elif field == "versions":
            out += [np.full(len(r), p.version, np.int64) for r in p.response_ids]
        else:
            out += [np.ones(len(r), np.uint8) for r in p.response_ids]
    return tuple(out)


def concat_chunks(parts: list[RolloutChunk]) -> RolloutChunk:
    """Several chunks as one, in order; its version the oldest."""
    if len(parts) == 1:
        return parts[0]
    return RolloutChunk(
        prompt_index=np.concatenate([p.prompt_index for p in parts]),
        prompt_ids=tuple(x for p in parts for x in p.prompt_ids),
        response_ids=tuple(x for p in parts for x in p.response_ids),
        logprobs=tuple(x for p in parts for x in p.logprobs),
        finished=np.concatenate([p.finished for p in parts]),
        version=min(p.version for p in parts), versions=_opt(parts, "versions"),
        masks=_opt(parts, "masks"), temperature=_one_temperature(parts))


def select_chunk(chunk: RolloutChunk, idx) -> RolloutChunk:
    """The responses at positions ``idx`` of ``chunk``."""
    idx = [int(i) for i in idx]

    def pick(xs):
        return None if xs is None else tuple(xs[i] for i in idx)
    return RolloutChunk(chunk.prompt_index[idx], pick(chunk.prompt_ids), pick(chunk.response_ids),
                        pick(chunk.logprobs), chunk.finished[idx], chunk.version,
                        pick(chunk.versions), pick(chunk.masks), chunk.temperature)


def chunk_bounds(n: int, chunks: int) -> list[tuple[int, int]]:
    """Cumulative [lo, hi) counts of finished responses that close each chunk."""
    chunks = max(1, min(chunks, n))
    edges = [round(i * n / chunks) for i in range(chunks + 1)]
    return [(edges[i], edges[i + 1]) for i in range(chunks)]


def _one_temperature(parts: list[RolloutChunk]) -> float:
    """The temperature chunks joined into one were sampled at: one, or the join is wrong."""
    temperatures = {p.temperature for p in parts}
    if len(temperatures) > 1:
        raise BackendError(f"responses sampled at one temperature must be joined, not at "
                           f"{sorted(temperatures)}")
    return parts[0].temperature


@attrs.frozen
class Cohort:
    """The prompts of one step, given to an engine that carries responses over steps.

    Under partial rollouts (a plan's ``carry``) the generate op of step s also starts the
    responses of steps s + 1 .. s + carry; ``params`` is how this call samples the cohort
    (its seed differs per step, cohort and replica). ``budget``: tokens each of its
    responses may have when the call ends (``rpeg.cost.partial.step_budget``; 0: no
    limit, as for the call's own step); one at its budget waits, unfinished, for the next.
    """

    step: int
    prompt_ids: tuple[np.ndarray, ...]
    params: SamplingParams
    budget: int = 0


@runtime_checkable
class GenerationEngine(Protocol):
    """What a generate op needs of an engine (torch + transformers, or vLLM)."""

    version: int

    def generate(self, prompt_ids: list[np.ndarray], params: SamplingParams,
                 chunks: int = 1, tools=None) -> Iterator[RolloutChunk]:
        """Sample one response per prompt; yield finished responses in ``chunks`` groups.
        With ``tools`` (``backends.turns.Toolbox``) a conversation per prompt instead."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Load new parameters in place (bucketed by the caller); serve ``version`` after."""
        ...

    def shutdown(self) -> None:
        ...


@runtime_checkable
class EngineCopy(Protocol):
    """A generation backend's engine serving a model's copy of its own (on devices no
    trainer uses, or at a tensor-parallel degree of its own), as a device's executor holds
    it among its replicas: each version reaches it from the trainer, and a checkpoint of it
    holds its version and partial rollouts, not weights."""

    version: int                        # the parameter version it serves

    def ready(self) -> GenerationEngine:
        """The engine, serving the version last received."""
        ...

    def receive(self, sync, version: int, host: int) -> dict:
        """One weight update through ``sync`` (the runtime's ``WeightSync``) for the engine
        on device ``host``; the bytes and buckets moved."""
        ...

    def begin_local(self) -> None:
        """A send on this engine's device starts loading it in process."""
        ...

    def load_local(self, names: list[str], tensors: list) -> None:
        ...

    def commit_local(self, version: int) -> None:
        ...

    def loaded(self, version: int) -> dict:
        """The receive of an update the send on its device loaded in process."""
        ...

    def checkpoint(self, path: str, meta: dict) -> None:
        ...

    def restore(self, path: str) -> int:
        """Serve the version a checkpoint of it names; that version."""
        ...

    def shutdown(self) -> None:
        ...


@runtime_checkable
class Executor(Protocol):
    """A device's op runner: the replicas of the models on one device (by model, each with
    its parameter ``version``), and what the runtime's worker asks of them. Built once per
    worker as ``Executor(ctx, device)`` (``ctx``: the runtime's ``RunContext``)."""

    replicas: dict[str, Any]

    def run(self, call, inputs: dict[str, list]) -> tuple[dict, dict]:
        """Run one op call (the runtime's ``OpCall``) on ``inputs`` (data name -> the values
        of its producers' calls); its outputs by data name, and what it observed
        (``version_read``, ``version_written``, ``stats``)."""
        ...

    def evaluate(self, model: str, step: int) -> dict:
        """The eval block on this device's replica of ``model``."""
        ...

    def carries(self, model: str) -> bool:
        """Whether the replica's engines keep partial rollouts a checkpoint must write."""
        ...

    def checkpoint(self, model: str, path: str, meta: dict) -> str:
        """Write the replica of ``model`` into folder ``path``; the folder."""
        ...

    def restore(self, model: str, path: str) -> int:
        """Load the replica of ``model`` a checkpoint wrote; its version."""
        ...

    def shutdown(self) -> None:
        ...


class Exporter(Protocol):
    """A backend's export of a trained model from a run directory's checkpoint as a Hugging
    Face folder (``backends.load(name, "export")``; what ``rpeg export`` runs): the model
    of the checkpoint at ``step`` (None: the newest) written to the folder ``out``, or with
    ``merge`` a LoRA actor's adapters folded in. Returns what it wrote: its ``model``,
    ``step``, ``version``, ``path`` and ``kind`` ("model", "merged" or "adapter")."""

    def __call__(self, run_dir, out, *, step: int | None = None, model: str = "actor",
                 merge: bool = False) -> Any:
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
    mask: np.ndarray | None = None     # a conversation's: 1 policy token, 0 observation
    turns: int = 0                     # a conversation's policy turns so far
    turn_start: int = 0                # where its current turn's tokens start
    cut: bool = False                  # ended by a cap, not by itself


@attrs.frozen
class CarriedState:
    """One generate op's partial-rollout buffer on one engine (``backends.carry``)."""

    key: str                           # the generate op
    step: int                          # the step it last served
    ends: int
    sampled: int
    responses: tuple[CarriedResponse, ...]
