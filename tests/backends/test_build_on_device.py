"""Models are built where they run, in the dtype they run in: on the device (``meta``
here, standing for a GPU: no byte of it in host memory), a folder's weights loaded straight
into bf16, a random init drawn in float32 on the device and then cast (the same values a
float32 build casts to: a frozen reference still equals its actor's initial weights).
Before, every model was built whole in float32 on the host and moved (an 8B model: 32 GB of
host memory per replica)."""

from __future__ import annotations

import torch

from backends.torch_backend.modeling import build_model
from rpeg.spec.presets import PRESETS


def test_a_model_is_built_on_its_device():
    model = build_model(PRESETS["tiny"], heads=("lm", "value"), seed=0, device="meta")
    assert {p.device.type for p in model.parameters()} == {"meta"}


def test_a_random_init_in_a_dtype_is_the_float32_init_cast():
    fp32 = build_model(PRESETS["tiny"], heads=("lm",), seed=3)
    bf16 = build_model(PRESETS["tiny"], heads=("lm",), seed=3, dtype=torch.bfloat16)
    a, b = dict(fp32.named_parameters()), dict(bf16.named_parameters())
    assert all(b[k].dtype == torch.bfloat16 and torch.equal(b[k], a[k].to(torch.bfloat16))
               for k in a)


def test_a_folders_weights_load_in_the_dtype(tmp_path):
    from backends.vllm_backend.models import save_policy
    model = build_model(PRESETS["tiny"], heads=("lm",), seed=1)
    save_policy(model, tmp_path / "m")
    loaded = build_model(PRESETS["tiny"], heads=("lm",), weights=str(tmp_path / "m"),
                         dtype=torch.bfloat16)
    ours = dict(model.named_parameters())
    for k, v in loaded.named_parameters():
        assert v.dtype == torch.bfloat16 and torch.equal(v, ours[k].to(torch.bfloat16))
