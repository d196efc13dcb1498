"""The torch + transformers backend: tiny and real models, sampling, forward, training.

    >>> from backends.torch_backend.executor import Executor   # what a Dask worker runs
    >>> from backends.torch_backend.generation import TorchEngine

Modules: ``tokenizer`` (bytes, built in code), ``modeling`` (models from presets
or weights; checkpoints), ``generation`` (the engine; finished responses in
chunks), ``train`` (forward passes, PPO / GRPO / value losses), ``advantages``
(GAE, group normalisation, RLOO), ``distributed`` (gloo / NCCL, DDP, DTensor
tensor parallelism),
``executor`` (the op calls of the runtime). Nothing here is imported by the
compile path.
"""
