# Template Makefile: two user-facing targets, `make demo` and `make test`.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Written after a successful install; pip runs again only when requirements-dev.txt is newer.
STAMP := $(VENV)/.requirements-dev.stamp
DEMO := build/my-trainer

.PHONY: demo test bench

demo: $(STAMP)
	rm -rf $(DEMO)
	$(BIN)/cookiecutter --no-input -f -o build .
	$(BIN)/python -m pip install -e $(DEMO)
	cd $(DEMO) && $(abspath $(BIN))/python -m my_trainer.train run.output_dir=runs/demo
	@echo "Demo project: $(DEMO)"
	@echo "Demo outputs: $(DEMO)/runs/demo (metrics.jsonl, checkpoints/)"

test: $(STAMP)
	$(BIN)/python -m pytest tests -q --durations=25

# CPU benchmarks (about 40 minutes on 2 cores): rewrites docs/performance.md's results and plot.
bench: $(STAMP)
	$(BIN)/python bench/run.py --docs

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): requirements-dev.txt | $(BIN)/python
	$(BIN)/python -m pip install -r requirements-dev.txt
	touch $@
