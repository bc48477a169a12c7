# exl3rt developer commands. `make demo` and `make test` create .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed
DEMO   ?= out/example-exl3

.PHONY: demo test bench-cpu clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# CPU build of torch (on local disk here); a looser pin would pull a multi-GB CUDA build
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[test]'
	touch $(STAMP)

## demo: write a small example EXL3 checkpoint and inspect it
demo: $(STAMP)
	$(VENV)/bin/exl3rt example $(DEMO) --overwrite
	$(VENV)/bin/exl3rt inspect $(DEMO)

## test: run the test suite (golden data in ../shared/golden, or EXL3RT_GOLDEN_DIR)
test: $(STAMP)
	$(PY) -m pytest -q

## bench-cpu: CPU reference decode throughput (writes benchmarks/results/decode_cpu.json)
bench-cpu: $(STAMP)
	$(PY) benchmarks/bench_decode_cpu.py

clean:
	rm -rf $(VENV) out .pytest_cache
