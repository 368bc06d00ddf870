# Two commands do all the set-up on a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint format bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip
	$(PY) -m pip install --quiet torch==2.14.1 torchvision==0.29.1 -e .[dev]
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/resnet_quickstart.py

# Two pytest workers, whole files each (a file's torchrun fixtures run once): most of the
# suite is Inductor compiles, single-threaded Python half of the time (15 min -> 12 here).
test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q -n 2 --dist loadfile

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

bench: $(STAMP)
	$(PY) -m functacc bench --model mlp

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
