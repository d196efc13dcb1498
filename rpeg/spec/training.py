"""Values for what a run reads, evaluates and reports: data fields, eval, log, LoRA.

    >>> Evaluation(dataset=FileRef("data/test.jsonl", "/exp/data/test.jsonl"), every=10,
    ...            samples=4).pass_k
    4
    >>> Lora(rank=8, alpha=16).scale
    2.0

``rpeg.spec.sections`` checks the text that makes them; ``rpeg.spec.model`` holds them
in a ``Workload`` (the data fields), a ``Model`` (``lora``) and the ``Pipeline``
(``evaluation``, ``log``).
"""

from __future__ import annotations

import enum

import attrs

from rpeg.errors import NOWHERE, Span
from rpeg.spec.paths import FileRef


class Template(enum.Enum):
    """How a prompt becomes tokens."""

    AUTO = "auto"        # the tokenizer's chat template when it has one, else the text as it is
    CHAT = "chat"        # always the chat template (a tokenizer without one is an error)
    RAW = "raw"          # the text as it is


class Truncation(enum.Enum):
    """What a prompt longer than the workload's prompt_len does (as verl's data.truncation)."""

    ERROR = "error"      # stops: check and run say which row (verl's default)
    LEFT = "left"        # keeps its last prompt_len tokens
    RIGHT = "right"      # keeps its first prompt_len tokens


class RewardForm(enum.Enum):
    """How a python reward is called (read from its signature, ``rpeg.spec.rewards``)."""

    BATCH = "batch"              # f(prompts, responses, answers, **columns): one call a batch
    PER_RESPONSE = "response"    # verl's compute_score(data_source, solution_str, ground_truth,
                                 # extra_info): one call a response, columns by name


class Tracker(enum.Enum):
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    MLFLOW = "mlflow"


@attrs.frozen
class Fields:
    """Which columns of a dataset are the prompt and the answer; the others reach the reward
    function by name."""

    prompt: str = "prompt"
    answer: str = "answer"


@attrs.frozen
class Evaluation:
    """``eval { dataset; every; samples; temperature; prompts; max_len }``: every ``every``
    steps (and before the first) the actor answers the held-out prompts ``samples`` times
    each; mean reward, pass@k and accuracy go to the metrics."""

    dataset: FileRef              # resolved where written (rpeg.spec.paths)
    every: int
    samples: int = 1
    temperature: float = 1.0
    prompts: int = 0              # 0: every row of the dataset
    max_len: int = 0              # 0: the generate stage's
    reward: str = ""              # the reward that scores it ("": the pipeline's only one)
    split: str | None = None      # a saved DatasetDict's split
    span: Span = attrs.field(default=NOWHERE, eq=False)
    keys: tuple[tuple[str, Span], ...] = attrs.field(default=(), eq=False, repr=False)

    @property
    def pass_k(self) -> int:
        return self.samples

    def span_of(self, key: str) -> Span:
        return dict(self.keys).get(key, self.span)


@attrs.frozen
class Logging:
    """``log { trackers = [...]; samples = N; project = "..." }``."""

    trackers: tuple[Tracker, ...] = (Tracker.TENSORBOARD,)
    samples: int = 4              # responses kept per step in samples.jsonl (0: none)
    project: str = "rpeg"
    span: Span = attrs.field(default=NOWHERE, eq=False)


@attrs.frozen
class Lora:
    """``lora = lora(rank = 8, alpha = 16, targets = [q_proj, v_proj], dropout = 0.0)``: the
    backbone stays frozen; low-rank adapters on the target projections train. The torch
    backend runs them with PEFT; the cost model prices the adapters' gradients, optimizer
    state and weight sync, and the backward pass without the frozen weights' gradients."""

    rank: int
    alpha: float = 0.0            # 0: equal to the rank (scale 1)
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    dropout: float = 0.0

    @property
    def scale(self) -> float:
        return (self.alpha or self.rank) / self.rank

    def params(self, dims) -> int:
        """Trainable parameters of the adapters on ``dims``: A (rank x in) and B (out x rank)
        on each target projection of every block. An MLP target on a mixture-of-experts
        layer adapts that projection of every routed and shared expert (as PEFT matches
        module names); latent attention (MLA) is priced as if its queries, keys and values
        were projected as a plain attention's."""
        return sum(n * self.rank * (i + o) for n, (i, o) in self._adapted(dims))

    def linears(self, dims) -> int:
        """How many projections carry adapters (each an A and a B tensor)."""
        return sum(n for n, _ in self._adapted(dims))

    def _adapted(self, dims) -> list[tuple[int, tuple[int, int]]]:
        """(how many in the model, (in, out) features) of each adapted projection."""
        dense = projection_shapes(dims)
        expert = projection_shapes(dims, dims.expert_ffn)
        routed = dims.experts + dims.shared_experts
        out = []
        for t in self.targets:
            if t in ATTENTION_TARGETS:
                out.append((dims.layers, dense[t]))
            elif t in dense:
                out.append((dims.layers - dims.moe_layers, dense[t]))
                if dims.moe_layers:
                    out.append((dims.moe_layers * routed, expert[t]))
        return out


ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
LORA_TARGETS = ATTENTION_TARGETS + MLP_TARGETS


def projection_shapes(dims, width: int | None = None) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear projection of a Llama-style block whose MLP is
    ``width`` wide (default: ``dims.ffn``). A plain (non-gated) MLP has no ``gate_proj``:
    its two matrices are ``up_proj`` and ``down_proj`` (OPT's fc1 and fc2)."""
    f = dims.ffn if width is None else width
    shapes = {"q_proj": (dims.hidden, dims.heads * dims.head_dim),
              "k_proj": (dims.hidden, dims.kv_dim), "v_proj": (dims.hidden, dims.kv_dim),
              "o_proj": (dims.q_dim, dims.hidden),
              "gate_proj": (dims.hidden, f), "up_proj": (dims.hidden, f),
              "down_proj": (f, dims.hidden)}
    if not dims.gated:
        del shapes["gate_proj"]
    return shapes
