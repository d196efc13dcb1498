"""How one op is split over its devices: the one value the plan places a stage by, the cost
model prices, the runtime lays its calls out by and the backends build their replicas by.

    >>> lay = Layout(dp=2, tp=4, zero=3, recompute=True)
    >>> lay.size, lay.shards, lay.zero.shards_params
    (8, 2, True)
    >>> Layout(decoding=Decoding(max_num_seqs=64)).decoding.max_num_seqs
    64

Device order inside an op's device tuple: tensor parallel fastest, then pipeline, then
data parallel, i.e. the device at position ``(d * pp + p) * tp + t`` holds data-parallel
replica d, pipeline stage p, tensor-parallel rank t (context-parallel ranks beside the
tensor-parallel ones). A generate op's engine settings are a small value of their own
(:class:`Decoding`), which only generation reads.
"""

from __future__ import annotations

import attrs

from rpeg.spec.model import Zero


@attrs.frozen(cache_hash=True)
class Decoding:
    """How a generate op's engine decodes, beside how the op is split."""

    max_num_seqs: int = 0     # sequences decoded at once per replica (0: what fits)
    kv_fraction: float = 0.0  # share of a device's memory the engine takes (0: what is free)
    cuda_graph: bool = False  # decode steps replayed from captured CUDA graphs


DECODING = Decoding()
DECODING_FIELDS = tuple(f.name for f in attrs.fields(Decoding))


@attrs.frozen(cache_hash=True)
class Layout:
    """How one op is split over its devices: data x pipeline x tensor (x context) parallel,
    what data parallelism shards (ZeRO), and how its passes run."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    microbatches: int = 1
    recompute: bool = False
    zero: Zero = attrs.field(default=Zero.NONE, converter=Zero.of)   # what DP shards (Zero)
    offload: bool = False     # train: optimizer state kept in host memory between train steps
    cp: int = 1               # context (sequence) parallel: each rank holds 1/cp of every sequence
    ep: int = 1               # expert parallel: the experts split over ep of the dp x cp x tp ranks
    packing: bool = False     # forward / train: sequences packed, no padding (token micro-batches)
    param_offload: bool = False   # weights in host memory between passes, brought in per layer
    decoding: Decoding = DECODING     # generate: the engine's own settings

    @property
    def size(self) -> int:
        """Devices the op runs on."""
        return self.dp * self.tp * self.pp * self.cp

    @property
    def shards(self) -> int:
        """Ranks ZeRO / FSDP shard a model copy over: data and context parallel."""
        return self.dp * self.cp


LAYOUT = Layout()


def layout_of(**fields) -> Layout:
    """A Layout from flat fields, a generate op's engine settings among them (the form plan
    files and placements are written in).

        >>> layout_of(dp=2, max_num_seqs=8) == Layout(dp=2, decoding=Decoding(max_num_seqs=8))
        True
    """
    decoding = _decoding_fields(fields)
    return Layout(**fields, decoding=Decoding(**decoding) if decoding else DECODING)


def changed(layout: Layout, **changes) -> Layout:
    """``layout`` with flat ``changes`` (its own fields, or its engine settings').

        >>> changed(Layout(dp=2), tp=2, cuda_graph=True).decoding.cuda_graph
        True
    """
    decoding = _decoding_fields(changes)
    if decoding:
        changes["decoding"] = attrs.evolve(layout.decoding, **decoding)
    return attrs.evolve(layout, **changes) if changes else layout


def _decoding_fields(fields: dict) -> dict:
    """The engine settings among flat ``fields``, taken out of them."""
    return {k: fields.pop(k) for k in DECODING_FIELDS if k in fields}


__all__ = ["DECODING", "DECODING_FIELDS", "Decoding", "LAYOUT", "Layout", "changed",
           "layout_of"]
