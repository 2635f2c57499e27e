# The two commands a fresh machine needs: `make book` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: book test unit notebooks test-noisy sync bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[book,test,mpi]'
	touch $(STAMP)

## Execute every chapter and build the HTML book in _build/html (warnings fail the build).
book: $(STAMP)
	$(BIN)/jupyter-book build . --warningiserror --keep-going --builder html

## Unit tests, then every chapter cell under nbval, in quick mode.
test: unit notebooks

## Two tests at a time (most wait on child processes, MPI jobs and threads), then, alone, the
## tests marked serial, which read the machine's load or their own CPU time.
unit: $(STAMP)
	D2LPERF_QUICK=1 $(BIN)/python -m pytest -q -n 2 -m 'not serial' tests
	D2LPERF_QUICK=1 $(BIN)/python -m pytest -q -m serial tests

NOTEBOOKS := D2LPERF_QUICK=1 $(BIN)/python -m pytest -q --nbval-lax --nbval-cell-timeout=600 chapters/*.ipynb

## Two chapters at a time, each whole in one worker (--dist loadfile): each chapter's timed
## verdicts hold beside a busy core (make test-noisy), which the other chapter is.
notebooks: $(STAMP)
	$(NOTEBOOKS) -n 2 --dist loadfile

## The notebook run while one core is kept busy, as by a browser or a noisy neighbour.
## The busy loop is killed when the run ends, passed or failed, and ends by itself if the
## shell that started it dies first (its parent changes).
BUSY_CORE := import itertools, os; parent = os.getppid(); \
	any(os.getppid() != parent for _ in itertools.count())

test-noisy: $(STAMP)
	$(BIN)/python -c '$(BUSY_CORE)' & busy=$$!; \
	trap 'kill $$busy 2>/dev/null' EXIT INT TERM; \
	$(NOTEBOOKS)

## Re-pair every chapter: the Markdown is the source, the notebook is rewritten from it.
sync: $(STAMP)
	$(BIN)/jupytext --update --to ipynb chapters/*.md

bench: $(STAMP)
	$(BIN)/python benchmarks/engine.py
	$(BIN)/python benchmarks/hybridize.py
	$(BIN)/python benchmarks/parallel.py
	$(BIN)/python benchmarks/training.py
	$(BIN)/python benchmarks/allreduce.py
	$(BIN)/python benchmarks/distributed.py

## Hundreds of real Ctrl-Cs (SIGINT) at random moments of a chain of additions, a pipeline
## step and a ZeRO step, on both engines: no hang, no lost or wrong value (a few minutes).
## Outside `make test`, so that CI stays within its budget; figures in benchmarks/RESULTS.md.
stress-ctrl-c: $(STAMP)
	$(BIN)/python benchmarks/ctrl_c_stress.py

## Redraw the schematic figures in images/ with the scripts beside them.
figures: $(STAMP)
	for script in images/*.py; do grep -q '^def main' $$script || continue; \
		$(BIN)/python $$script || exit 1; done

## Everything GPU-specific on gpu(0), one report in _build/gpu-check.md (tests/gpu_check.py).
## Needs no .venv and no network: the venv's Python if there is one, else $(PYTHON), with
## NumPy and CuPy. GPU_CHECK_ARGS=--quick runs the small workloads.
GPU_CHECK_PYTHON := $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
gpu-check:
	$(GPU_CHECK_PYTHON) tests/gpu_check.py $(GPU_CHECK_ARGS)

## Open every page of _build/html in headless Chromium, as a reader with no network would:
## fails on a formula left as TeX, an image that did not load, a request off the machine or a
## JavaScript error; saves _build/parameter_servers.png. Needs Chromium (apt-get install
## chromium, or D2LPERF_BROWSER=/path/to/chrome); without one it says how to get it, exits 2.
check-html: $(STAMP)
	$(BIN)/python tests/check_html.py _build/html \
		--screenshot chapters/parameter_servers.html=_build/parameter_servers.png

.PHONY: figures gpu-check check-html stress-ctrl-c

clean:
	rm -rf _build
