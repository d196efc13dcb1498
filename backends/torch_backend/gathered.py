"""A forward pass on a trainer's ZeRO-3 shards, read in place: every rank of the trainer
runs its share of the pass with the trainer's own FSDP2 module, which all-gathers each
layer's weights over the group as it runs it, and the ranks exchange their outputs.

    >>> out = forward_on_shards(replica.trained, chunk.prompt_ids, chunk.response_ids, "logprobs",
    ...                         rank=1, world=2, device="cpu")         # doctest: +SKIP
    >>> len(out) == len(chunk.response_ids)                            # doctest: +SKIP
    True

The plan places such a pass where its reader spans its trainer's ranks unchunked
(``rpeg.plan.oplayout.gathers_in_place``): no copy of the weights of its own, no weight
sync, a layer's gathered weights at a time (as DeepSpeed-Chat's hybrid engine and verl's
FSDP workers read their actor). The ranks take token-balanced shares of the responses
(``batching.balance``, as a train op deals them); every rank runs as many passes (a rank short of micro-batches runs one-token passes),
since each pass gathers every layer with all of them.
"""

from __future__ import annotations

import numpy as np
import torch

from backends.torch_backend.batching import balance, micro_batches
from backends.torch_backend.batching import build as build_rows
from backends.torch_backend.tokenizer import PAD_ID
from backends.torch_backend.train import _per_sequence, token_outputs


def forward_on_shards(trained, prompt_ids, response_ids, what: str, *, rank: int, world: int,
                      device: str = "cpu", temperature: float = 1.0, microbatches: int = 1,
                      packed: bool = False):
    """Per-token ``logprobs`` or ``values`` (a tuple of arrays, every response's) of a pass
    run by rank ``rank`` of the ``world`` ranks whose ``trained`` (``sharding.Trained``)
    FSDP2 holds sharded (ZeRO-3), each on its share of the responses (see the module doc);
    every rank returns them all."""
    from backends.torch_backend.distributed import group_of
    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids, strict=True)]
    shares = balance(lengths, world)         # as the train op deals its ranks' rows
    groups = [[[share[i] for i in g] for g in micro_batches([lengths[i] for i in share],
                                                            microbatches) if g]
              for share in shares]
    passes = max(len(g) for g in groups)
    trained.unsettle()                       # the sharded parameters, as the trainer left them
    heads = trained.heads                    # the FSDP2 root: it gathers the embeddings too
    with torch.no_grad():
        lp, _, values = _per_sequence(heads, prompt_ids, response_ids, groups[rank], packed,
                                      device, temperature)
        for _ in range(passes - len(groups[rank])):       # as many gathers as the others
            one = build_rows([np.asarray([PAD_ID])], [np.asarray([PAD_ID])], packed, device)
            token_outputs(heads, one, temperature)
    out = lp if what == "logprobs" else values
    mine = {i: out[i] for i in shares[rank]}
    every: list = [None] * world
    torch.distributed.all_gather_object(every, mine, group=group_of(trained.layout.world))
    merged = {i: a for part in every for i, a in part.items()}
    return tuple(merged[i] for i in range(len(lengths)))


__all__ = ["forward_on_shards"]
