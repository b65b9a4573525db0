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
	$(PIP) install -q --no-compile -c constraints.txt torch==2.13.0
	$(PIP) install -q --no-compile -c constraints.txt -e ".[hf,lightning,mlx,dev]"
	# LitGPT's own model code, for tests/test_litgpt_code.py: --no-deps, as its pins (huggingface-hub<1.4,
	# psutil==7.2.2) conflict with transformers 5; what it imports, the extras above install
	$(PIP) install -q --no-compile --no-deps litgpt==0.5.13
	# byte-compiled on every core at once (pip compiles one file at a time); a file that does not
	# compile under this Python (torch ships a 3.12-syntax test helper) is skipped, as pip skips it
	$(PY) -m compileall -q -j 0 $$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") > /dev/null || true
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/memguard demo

# Tests whose outcome depends on how fast the guard reacts (a co-tenant arriving mid-run under a
# real cgroup limit, grow-back, a supervisor killing and restarting runs) or on the timing of gloo's
# threads (the per-rank heap of 2-process runs, scored against the estimate's band) or of MLX's
# CPU worker (the order it frees arrays in moves allocator peaks by whole arrays), or that compare a
# run's peak RSS with the estimate to a few percent (a ViT run), run alone,
# after the others; the rest run on 2 workers, one test file per worker at a time, the files that take
# minutes first (conftest.py; --no-loadscope-reorder keeps that order: pytest-xdist otherwise queues
# the files with the most tests first, which puts the slowest one-test files last).
SERIAL := integration_tests/test_containers.py integration_tests/test_grow_back.py \
          integration_tests/test_supervisor_resume.py tests/test_supervisor.py \
          integration_tests/test_distributed_estimate.py integration_tests/test_lightning_ddp_redo.py \
          tests/test_mlx_census.py tests/test_image_guarded_run.py

test: install
	$(PY) -m pytest -q --durations=15 -n 2 --dist loadfile --no-loadscope-reorder $(addprefix --ignore=,$(SERIAL)) tests integration_tests
	$(PY) -m pytest -q --durations=10 $(SERIAL)
	$(VENV)/bin/memguard bench --quick --gate

unit: install
	$(PY) -m pytest -q tests

integration: install
	$(PY) -m pytest -q integration_tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
