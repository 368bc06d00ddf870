# Two commands do all the set-up on a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-torch lint format bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip
	$(PY) -m pip install --quiet torch==2.14.1 torchvision==0.29.1 -e .[dev]
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# Two pytest workers, whole files each (a file's torchrun fixtures run once). On a cold
# Inductor cache 51 min on the 2-core Xeon of 2026-11-30, 1705 tests (68 min for 1644
# the day before), far over the 20 minutes aimed at: Inductor tests ~40% of test time
# (a g++ run of 1-1.5 s per kernel), torchrun ~16%, the rest mostly jit's traces.
test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q -n 2 --dist loadfile

# The suite on another torch of the supported range (pyproject.toml), in its own venv:
# `make test-torch TORCH=2.15.0` (what pip gives users today) or TORCH=2.11.0 (the GPU
# machines' torch). Each torch needs its torchvision; others: add TORCHVISION=x.y.z.
# PIP_CONSTRAINT=/dev/null lifts a pip-wide cap on torch where a machine sets one (this one
# caps it at the pinned 2.14.1), since the point here is another torch than the pin.
TORCHVISION_FOR_2.11.0 := 0.26.0
TORCHVISION_FOR_2.14.1 := 0.29.1
TORCHVISION_FOR_2.15.0 := 0.29.2
TORCHVISION ?= $(TORCHVISION_FOR_$(TORCH))
PYTEST_ARGS ?= -q -n 2 --dist loadfile

.venv-torch-%/.installed: pyproject.toml
	@test -n "$(TORCHVISION)" || { echo "make test-torch: no torchvision known for torch '$*'; \
	name one, e.g. make test-torch TORCH=$* TORCHVISION=0.29.2"; exit 2; }
	$(PYTHON) -m venv .venv-torch-$*
	PIP_CONSTRAINT=/dev/null .venv-torch-$*/bin/python -m pip install --upgrade --quiet pip
	PIP_CONSTRAINT=/dev/null .venv-torch-$*/bin/python -m pip install --quiet \
		torch==$* torchvision==$(TORCHVISION) -e .[dev]
	touch $@

test-torch:
	@test -n "$(TORCH)" || { echo "make test-torch: say which torch, e.g. TORCH=2.15.0"; exit 2; }
	$(MAKE) .venv-torch-$(TORCH)/.installed
	.venv-torch-$(TORCH)/bin/python -c "import torch; assert torch.__version__.split('+')[0] \
		== '$(TORCH)', f'it has torch {torch.__version__}: rm -r .venv-torch-$(TORCH)'"
	.venv-torch-$(TORCH)/bin/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

bench: $(STAMP)
	$(PY) -m functacc bench --model mlp

clean:
	rm -rf $(VENV) .venv-torch-* build *.egg-info .pytest_cache .ruff_cache
