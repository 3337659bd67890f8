# `make test` is the test command CI runs (.ci/run); `make demo` runs the main job.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo notebooks venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: this machine carries the 2.13.0 CPU wheel; an unpinned torch would pull a CUDA build.
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[plot,test,notebooks,parity]"
	touch $(STAMP)

# Test files run on TEST_WORKERS processes (pytest-xdist), each file whole on one worker so its fixtures and
# compiled programs are built once. XLA compiles on one thread (a serial test file keeps ~1.25 of 2 cores busy),
# so two workers use CI's second core. Files are handed out longest first (tests/conftest.py's LONGEST_FILES), in
# that order rather than xdist's most-tests-first, so the run does not end on one long file.
TEST_WORKERS ?= 2

# The linter runs first (pyproject.toml's [tool.ruff]; alone: `.venv/bin/ruff check .`): a lint error fails the target.
test: $(STAMP)
	$(PY) -m ruff check .
	JAX_PLATFORMS=cpu $(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

demo: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) -m csa2 inspect --preset v41_flash --context 1048576
	JAX_PLATFORMS=cpu $(PY) -m train.demo

# Re-run every notebook at full size and save its outputs (what is committed; `make test` runs them fast).
notebooks: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) -m experiments.notebooks

clean:
	rm -rf $(VENV)
