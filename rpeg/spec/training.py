"""Values for what a run reads, evaluates and reports: data fields, eval, log, LoRA.

    >>> Evaluation(dataset="data/test.jsonl", every=10, samples=4).pass_k
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


class Template(enum.Enum):
    """How a prompt becomes tokens."""

    AUTO = "auto"        # the tokenizer's chat template when it has one, else the text as it is
    CHAT = "chat"        # always the chat template (a tokenizer without one is an error)
    RAW = "raw"          # the text as it is


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

    dataset: str
    every: int
    samples: int = 1
    temperature: float = 1.0
    prompts: int = 0              # 0: every row of the dataset
    max_len: int = 0              # 0: the generate stage's
    reward: str = ""              # the reward that scores it ("": the pipeline's only one)
    split: str | None = None      # a saved DatasetDict's split
    span: Span = attrs.field(default=NOWHERE, eq=False)

    @property
    def pass_k(self) -> int:
        return self.samples


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
    backbone stays frozen; low-rank adapters on the target projections train."""

    rank: int
    alpha: float = 0.0            # 0: equal to the rank (scale 1)
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    dropout: float = 0.0

    @property
    def scale(self) -> float:
        return (self.alpha or self.rank) / self.rank

    def params(self, dims) -> int:
        """Trainable parameters of the adapters on ``dims`` (A: r x in, B: out x r, per layer)."""
        shapes = projection_shapes(dims)
        return dims.layers * sum(self.rank * (shapes[t][0] + shapes[t][1]) for t in self.targets)


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def projection_shapes(dims) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear projection of a Llama-style block."""
    q = dims.heads * dims.head_dim
    return {"q_proj": (dims.hidden, q), "k_proj": (dims.hidden, dims.kv_dim),
            "v_proj": (dims.hidden, dims.kv_dim), "o_proj": (q, dims.hidden),
            "gate_proj": (dims.hidden, dims.ffn), "up_proj": (dims.hidden, dims.ffn),
            "down_proj": (dims.ffn, dims.hidden)}
