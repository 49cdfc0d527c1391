# Two commands for a new user: `make demo` and `make test`.
PYTHON      ?= python3
VENV        ?= .venv
TORCH_SPEC  ?= torch==2.13.0
BIN         := $(VENV)/bin
STAMP       := $(VENV)/.installed

.PHONY: demo embeddings bench test install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Torch first, pinned: an unpinned torch pulls several GB of CUDA packages.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# A notebook executed headless at full size: reports/<name>.html (and whatever JSON it writes there).
NBCONVERT := PSCLUSTER_REPORT_DIR=$(CURDIR)/reports IPP_NONINTERACTIVE=1 $(BIN)/jupyter nbconvert --to html \
	--execute --ExecutePreprocessor.timeout=1800 --ExecutePreprocessor.store_widget_state=False --output-dir reports

demo: $(STAMP)
	mkdir -p reports
	$(NBCONVERT) notebooks/01_quickstart.ipynb
	@echo "report: reports/01_quickstart.html reports/01_quickstart.json"

# Placement strategies and a 2M-row sparse embedding table across ps tasks (several minutes on 2 cores).
embeddings: $(STAMP)
	mkdir -p reports
	$(NBCONVERT) notebooks/03_placement_and_embeddings.ipynb
	@echo "report: reports/03_placement_and_embeddings.html"

bench: $(STAMP)
	$(BIN)/python benchmarks/dashboard_overhead.py
	$(BIN)/python benchmarks/dataplane.py

test: $(STAMP)
	IPP_NONINTERACTIVE=1 $(BIN)/python -m pytest

clean:
	rm -rf $(VENV) reports .pytest_cache
