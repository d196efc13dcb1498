"""rpeg: compile, plan, run and verify reinforcement-learning pipelines for language models."""

__version__ = "0.1.0"
