"""How rpeg starts a vLLM engine on a GPU, as rules (no vLLM or GPU needed): in the
model's dtype (float32 before: twice the memory priced), in processes of their own shown
the engine's GPUs (vLLM's single-process executor took GPU 0 of every worker), sleeping
between generate calls where it shares a GPU with a trainer; on a CPU as it ran before."""

from __future__ import annotations

import pytest

from backends.vllm_backend.colocated import colocated_options
from backends.vllm_backend.engine import VllmOptions, engine_dtype, runs_isolated


@pytest.mark.parametrize("dtype, want", [("bf16", "bfloat16"), ("fp16", "float16"),
                                         ("fp32", "float32")])
def test_an_engine_serves_the_models_dtype_on_a_gpu_float32_on_a_cpu(dtype, want):
    assert engine_dtype(dtype, gpu=True) == want
    assert engine_dtype(dtype, gpu=False) == "float32"


def test_an_engine_beside_its_trainer_on_a_gpu_sleeps_in_its_own_processes():
    on_gpu = colocated_options("bf16", gpus="3", sleep=True)
    assert (on_gpu.dtype, on_gpu.gpus, on_gpu.sleep) == ("bfloat16", "3", True)
    assert runs_isolated(on_gpu, gpu=True, distributed=False)          # not GPU 0 in-process
    on_cpu = colocated_options("bf16", gpus="", sleep=True)
    assert (on_cpu.dtype, on_cpu.gpus, on_cpu.sleep) == ("float32", "", False)
    assert not runs_isolated(on_cpu, gpu=False, distributed=False)     # in process, as before
    assert runs_isolated(on_cpu, gpu=False, distributed=True)          # beside a world


def test_a_tensor_parallel_engine_always_has_processes_of_its_own():
    assert runs_isolated(VllmOptions(tensor_parallel=2), gpu=False, distributed=False)
