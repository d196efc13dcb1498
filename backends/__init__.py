"""Execution backends: the only code in rpeg that touches tensors.

The runtime finds a backend by name (``torch``, ``vllm``) through
``backends.load(name)``; each implements the contract in ``backends.api``.
"""
