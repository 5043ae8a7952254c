# lomo_ds: `make demo` fine-tunes the built-in default on this machine (CPU, two ranks);
# `make test` runs the test suite. Both install what they need first.
PYTHON ?= python3
NPROC ?= 2
PYTEST_ARGS ?=

.PHONY: install demo test plan table1 table2 table3 table1-cpu table2-cpu table3-cpu clean

# torch: the CUDA build where an NVIDIA driver is present, else the small CPU build
# (an unpinned torch on a machine without a GPU would pull the multi-GB CUDA build).
.installed: setup.py
	@if ! $(PYTHON) -c "import torch" 2>/dev/null; then \
		if command -v nvidia-smi >/dev/null 2>&1; then $(PYTHON) -m pip install "torch>=2.4,<2.14"; \
		else $(PYTHON) -m pip install "torch==2.13.0"; fi; fi
	$(PYTHON) -m pip install -e ".[test,experiments]"
	@touch .installed

install: .installed

demo: .installed
	deepspeed --num_gpus $(NPROC) launch/train.py --config ds_configs/cpu_default.json

test: .installed
	$(PYTHON) -m pytest -q tests $(PYTEST_ARGS)

clean:
	rm -rf runs outputs .installed
