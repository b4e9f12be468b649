# fl_lightning: `make train` runs the default offline job, `make test` runs the test suite.
# Both create the virtualenv (.venv) on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export WANDB_MODE ?= offline

.PHONY: train test lint experiment reproduce reproduce-digits reproduce-table1-digits leaderboard bench bench-gpu mutation mutation-report clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

train: $(STAMP)
	$(PY) train.py --config configs/quickstart.yaml --overwrite true

# the suite on 2 processes (pytest-xdist), one torch thread each (tests/conftest.py; the variables below reach the
# tests' own child processes): a whole test file goes to one process, so a module-scoped fixture (one train.py run
# shared by a file's checks) runs once. `$(PY) -m pytest tests` runs it serially.
test: $(STAMP)
	WANDB_MODE=disabled OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(PY) -m pytest -n 2 --dist loadfile tests
	$(PY) -m ruff check .

lint: $(STAMP)
	$(PY) -m ruff check .

# an experiment file: make experiment FILE=configs/experiments/quick_digits.yaml [ARGS="--jobs 2"]
FILE ?= configs/experiments/quick_digits.yaml
experiment: $(STAMP)
	$(PY) -m fl_lightning.experiment run $(FILE) $(ARGS)

# six methods of configs/experiments/table1_digits.yaml × 3 seeds, mean ± std (run dirs shared with the next target)
reproduce-digits: $(STAMP)
	$(PY) -m experiments digits

# configs/experiments/table1_digits.yaml: the 15 methods × 3 seeds, next to the ordering checks
reproduce-table1-digits: $(STAMP)
	$(PY) -m experiments table1 --dataset digits

# the leaderboard (docs/leaderboard.md): configs/experiments/leaderboard_digits.yaml, every method tuned on a validation
# split (grid extended past an edge winner), then 5 fresh seeds; writes docs/leaderboard.csv/.md and the figures.
# make leaderboard ARGS=--check: a rerun's CSV against the committed one
leaderboard: $(STAMP)
	$(PY) -m experiments leaderboard $(ARGS)

# every reproduction runner (each prints a table, writes PNGs and results/NAME/results.json)
reproduce: $(STAMP)
	@for name in $$($(PY) -c "from experiments.__main__ import available; print(' '.join(available()))"); do \
		echo "== reproduce $$name"; $(PY) -m experiments $$name || exit 1; done

bench: $(STAMP)
	$(PY) -m benchmarks.bench
	$(PY) -m benchmarks.scale

# issue 42's GPU measurements in one command, under 5 minutes on one H100/H200 (benchmarks/gpu.py: every gradient
# method's sequential and auto s/round, FedAvg's TFLOP/s against the card's peak, model.compile and bf16, a 5-seed
# grid batched vs alone); results/bench/gpu/. make bench-gpu ARGS=--smoke: its smallest size, on the CPU
bench-gpu: $(STAMP)
	$(PY) -m benchmarks.gpu $(ARGS)

# mutation testing ([tool.mutmut] in pyproject.toml; not part of `make test` or CI). Incremental: mutants/ keeps every
# verdict and only functions whose source changed are re-tested; MUTANTS="fl_lightning.metrics*" re-tests those by name
# (after adding tests that should kill survivors). Then prints the kill rate per module (tools/mutation_report.py).
# Each mutated function is tested with its MUTATION_MAX_TESTS fastest tests, at most MUTATION_MAX_SECONDS of recorded
# test time (0: no cap; see tools/mutation_run.py); the kill rate is then a lower bound.
MUTATION_STAMP := $(VENV)/.installed-mutation
MUTANTS ?=
MUTATION_MAX_TESTS ?= 20
MUTATION_MAX_SECONDS ?= 5
$(MUTATION_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e ".[test,mutation]"
	touch $(MUTATION_STAMP)

mutation: $(MUTATION_STAMP)
	OMP_NUM_THREADS=1 WANDB_MODE=disabled $(PY) tools/mutation_run.py --max-tests $(MUTATION_MAX_TESTS) \
		--max-seconds $(MUTATION_MAX_SECONDS) --max-children 2 $(MUTANTS)
	$(PY) tools/mutation_report.py

mutation-report: $(STAMP)
	$(PY) tools/mutation_report.py --survivors

clean:
	rm -rf runs results wandb lightning_logs mutants
