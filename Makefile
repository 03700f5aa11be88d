# The whole set-up is two commands on a fresh machine (see README):
#   make run    installs into .venv and runs the main job
#   make test   installs into .venv and runs the tests
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Each `make run` trains into a fresh run directory (shardax never overwrites a run's
# checkpoints); runs/latest points at the newest, linked before training starts so that an
# interrupted run continues with `--out runs/latest --resume`.
ifndef RUN
RUN := runs/$(shell date +%Y%m%d-%H%M%S)
endif

.PHONY: install run test lint bench check-transformers clean

# uv resolves and installs in parallel: ~40 s from an empty cache where pip took ~2 minutes
# (single-threaded unpacking and byte-compiling). It reads no pip configuration, so where it
# cannot reach its index (PyPI) the install falls back to pip, which reads pip.conf's mirrors.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	{ $(PY) -m pip install --quiet uv && \
	  $(VENV)/bin/uv pip install --quiet --python $(PY) --compile-bytecode -e '.[all,dev]'; } || \
	{ $(PY) -m pip install --quiet --upgrade pip && $(PY) -m pip install --quiet -e '.[all,dev]'; }
	touch $@

install: $(VENV)/.installed

run: install
	$(PY) examples/quickstart.py
	mkdir -p runs
	ln -sfn $(notdir $(RUN)) runs/latest
	$(VENV)/bin/shardax train --out $(RUN)

# Two workers, each file on one worker (files share their expensive reference runs); the
# docstring examples of src/shardax run too (--doctest-modules in pyproject.toml; the 8-device
# set-up is conftest.py's). The package's own modules are byte-compiled first: an editable
# install leaves them to the first import, and with PYTHONDONTWRITEBYTECODE set every one of
# the suite's fresh processes (multi-process workers, plan compile servers) compiled them again
# (~0.3 s of CPU each).
test: install
	$(PY) -m compileall -q src
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=15 tests src/shardax

lint: install
	$(VENV)/bin/ruff check .

# CPU benchmarks (~45-50 min on 2 cores): writes benchmarks/RESULTS.md; scalax goes into
# benchmarks/.peers, never into $(VENV).
bench: install
	$(PY) benchmarks/run.py

# Hugging Face exports loaded by transformers itself: torch + transformers in a separate
# environment (about 4 GB with torch's CUDA libraries, so never part of `make test`).
HF_VENV ?= .venv-transformers
check-transformers:
	$(PYTHON) -m venv $(HF_VENV)
	$(HF_VENV)/bin/python -m pip install --quiet -e '.[train,hf]' torch transformers
	$(HF_VENV)/bin/python benchmarks/hf_transformers.py

clean:
	rm -rf $(VENV) $(HF_VENV) runs
