# memguard: the two commands of README, each installing what it needs into .venv.
#   make demo   a guarded real LoRA fine-tune (HF Trainer on CPU)
#   make test   unit tests + integration tests (real training on CPU, real cgroup limits)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.memguard-installed

.PHONY: install demo test unit integration clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned: a plain `torch` requirement would pull a multi-GB CUDA build here
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ".[hf,lightning,mlx,dev]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/memguard demo

test: install
	$(PY) -m pytest -q tests integration_tests
	$(VENV)/bin/memguard bench --quick --gate

unit: install
	$(PY) -m pytest -q tests

integration: install
	$(PY) -m pytest -q integration_tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
