"""The torch + transformers backend: tiny and real models, sampling, forward, training.

    >>> from backends.torch_backend.executor import Executor   # what a Dask worker runs
    >>> from backends.torch_backend.generation import TorchEngine

Modules: ``tokenizer`` (bytes, built in code), ``modeling`` (models from presets
or weights; checkpoints), ``generation`` (the engine; finished responses in
chunks), ``train`` (forward passes, PPO / GRPO / value losses), ``batching``
(padded or packed rows, token-balanced shares and micro-batches), ``attention``
(packed rows attended per sequence), ``advantages`` (GAE, group normalisation,
RLOO), ``distributed`` (gloo / NCCL, DDP, DTensor tensor parallelism),
``sharding`` (a trained replica's layout: FSDP2 ZeRO-2/3, 2-D meshes, recomputation,
offload, precision), ``weights`` (weight transfers between layouts), ``state``
(sharded state gathered for checkpoints), ``executor`` (the op calls of the
runtime). Nothing here is imported by the compile path.
"""
