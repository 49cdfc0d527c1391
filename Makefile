# Two commands for a new user: `make demo` and `make test`.
PYTHON      ?= python3
VENV        ?= .venv
TORCH_SPEC  ?= torch==2.13.0
BIN         := $(VENV)/bin
STAMP       := $(VENV)/.installed

.PHONY: demo embeddings bench bench-check test docs faults install bytecode labextension dist wheel-check chromium multihost-deps slurm-deps clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Torch first, pinned: an unpinned torch pulls several GB of CUDA packages.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# The bytecode of the checkout's modules, as installing a wheel writes it: with an editable install under
# PYTHONDONTWRITEBYTECODE (set on CI) nothing else writes it, and every engine, kernel and task would compile
# pscluster again (about 0.3 s of CPU each). Files already compiled are skipped.
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q pscluster benchmarks

# The side panel's labextension, rebuilt when its sources change, then reinstalled into the venv (an install
# from a clean tree builds it through hatch-jupyter-builder). jlpm ships in jupyter-builder.
LABEXT_BUILT := pscluster/labextension/static/style.js
LABEXT_SOURCES := $(wildcard labextension/src/*.ts labextension/style/*) labextension/package.json
$(LABEXT_BUILT): $(LABEXT_SOURCES) | $(STAMP)
	cd labextension && PATH=$(CURDIR)/$(BIN):$$PATH jlpm install && PATH=$(CURDIR)/$(BIN):$$PATH jlpm build:prod
	$(BIN)/python -m pip install --quiet --no-deps -e .

labextension: $(LABEXT_BUILT)

# The sdist and the wheel in dist/, both with the side panel prebuilt inside (installing either needs no node),
# from a venv of their own holding only `build` (no torch, no .venv): `python -m build` installs the build backend
# of pyproject.toml into an isolated env, whose hatch-jupyter-builder builds the side panel with jlpm (from
# jupyter-builder) and node when it is missing. One older than its sources is rebuilt, then reinstalled into .venv
# when there is one (as `make labextension` does).
BUILD_VENV  := .build-venv
BUILD_STAMP := $(BUILD_VENV)/.installed
$(BUILD_STAMP):
	$(PYTHON) -m venv $(BUILD_VENV)
	$(BUILD_VENV)/bin/python -m pip install --quiet "build>=1.2"
	touch $(BUILD_STAMP)

dist: $(BUILD_STAMP)
	rm -rf dist
	stale="$$(find $(LABEXT_SOURCES) -newer $(LABEXT_BUILT) 2>/dev/null)"; \
	if [ -n "$$stale" ]; then rm -rf pscluster/labextension; fi; \
	$(BUILD_VENV)/bin/python -m build --sdist --wheel --outdir dist . && \
	if [ -n "$$stale" ] && [ -f $(STAMP) ]; then $(BIN)/python -m pip install --quiet --no-deps -e .; fi

# The wheel installed into a fresh venv, torch from TORCH_SPEC first: %load_ext pscluster, both extensions
# enabled, the side panel drawn by a JupyterLab of that venv in chromium (tests/packaging).
wheel-check: $(STAMP) dist chromium
	PSCLUSTER_WHEEL="$$(ls dist/pscluster-*.whl)" TORCH_SPEC="$(TORCH_SPEC)" IPP_NONINTERACTIVE=1 \
		$(BIN)/python -m pytest tests/packaging

# Browser tests drive Debian's chromium (never a browser downloaded by playwright).
chromium:
	@test -x /usr/bin/chromium || (apt-get update && apt-get install -y chromium)

# Multi-host tests: network namespaces (iproute2) as hosts, each running sshd for ipyparallel's SSH launcher;
# the MPI launcher test runs Open MPI's mpiexec.
multihost-deps:
	@test -x /usr/sbin/sshd -a -x /usr/bin/ssh -a -x /usr/sbin/ip -a -x /usr/bin/mpiexec || \
		(apt-get update && apt-get install -y openssh-server openssh-client iproute2 openmpi-bin)

# The Slurm launcher test (tests/multihost/test_slurm.py) starts its own munged, slurmctld and slurmd on loopback.
slurm-deps:
	@test -x /usr/sbin/slurmctld -a -x /usr/sbin/slurmd -a -x /usr/sbin/munged -a -x /usr/bin/sbatch || \
		(apt-get update && apt-get install -y slurmctld slurmd munge slurm-client)

# A notebook executed headless at full size: reports/<name>.html (and whatever JSON it writes there).
NBCONVERT := PSCLUSTER_REPORT_DIR=$(CURDIR)/reports IPP_NONINTERACTIVE=1 $(BIN)/jupyter nbconvert --to html \
	--HTMLExporter.preprocessors=pscluster.report.InlinePlotly \
	--execute --ExecutePreprocessor.timeout=1800 --ExecutePreprocessor.store_widget_state=False --output-dir reports

demo: $(STAMP) bytecode
	mkdir -p reports
	$(NBCONVERT) notebooks/01_quickstart.ipynb
	@echo "report: reports/01_quickstart.html reports/01_quickstart.json"

# Placement strategies and a 2M-row sparse embedding table across ps tasks (several minutes on 2 cores).
embeddings: $(STAMP) bytecode
	mkdir -p reports
	$(NBCONVERT) notebooks/03_placement_and_embeddings.ipynb
	@echo "report: reports/03_placement_and_embeddings.html"

# Every benchmark (about 25 min on 2 cores): benchmarks/results/*.json and the tables of benchmarks/README.md;
# run_view drives the side panel in headless chromium, hence the lab extension and chromium.
BENCH_STAMP := $(VENV)/.bench-installed
$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e ".[test,bench]"
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP) $(LABEXT_BUILT) bytecode chromium
	$(BIN)/python -m benchmarks.run

# Every benchmark at its tiny size, to check that each runs and the tables regenerate (tests/bench/test_tiny_run.py,
# about 2 minutes on 2 cores; CI runs it after the suite).
bench-check: $(STAMP) $(LABEXT_BUILT) bytecode chromium
	PSCLUSTER_BENCH_CHECK=1 IPP_NONINTERACTIVE=1 $(BIN)/python -m pytest tests/bench/test_tiny_run.py

# The suite in TEST_WORKERS processes (pytest-xdist), each test file whole in one of them (its module fixtures,
# clusters and labs started once): most of a test is waiting on engines, kernels and a browser, so two at once
# keep both cores busy.
TEST_WORKERS ?= 2
test: $(STAMP) $(LABEXT_BUILT) bytecode chromium multihost-deps slurm-deps
	IPP_NONINTERACTIVE=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

# The documentation site (mkdocs.yml, docs/) into site/, the docs extra installed into .venv once; a warning (a
# broken link, a docstring mkdocstrings cannot read) fails the build.
DOCS_STAMP := $(VENV)/.docs-installed
$(DOCS_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e ".[docs]"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# Every fault on every role at every bad moment (tests/faults, about 15 minutes on 2 cores): reports/faults.json;
# then the fuzz tests of the servers with ten times their examples.
faults: $(STAMP) bytecode
	mkdir -p reports
	PSCLUSTER_FAULT_MATRIX=1 PSCLUSTER_REPORT_DIR=$(CURDIR)/reports IPP_NONINTERACTIVE=1 $(BIN)/python -m pytest tests/faults
	PSCLUSTER_FUZZ_SCALE=10 $(BIN)/python -m pytest -m fuzz tests/unit tests/labserver

clean:
	rm -rf $(VENV) $(BUILD_VENV) reports .pytest_cache dist pscluster/labextension labextension/lib labextension/node_modules
