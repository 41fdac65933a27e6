# Template Makefile: two user-facing targets, `make demo` and `make test`.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Written after a successful install; pip runs again only when requirements-dev.txt is newer.
STAMP := $(VENV)/.requirements-dev.stamp
DEMO := build/my-trainer

.PHONY: demo test bench lock

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

# requirements-lock.txt pins every package requirements-dev.txt pulls in, as `make lock` resolved them.
# Installing it needs no resolution and runs in three pips at once (torch with its CUDA libraries,
# and two halves of the rest): 110 s instead of 255 s on 2 cores. Then pip checks that the packages
# fit together, and installs requirements-dev.txt as such, which adds only what a stale lock lacks.
# A lock that cannot install here (another Python, say) leaves that last step to install it all.
HEAVY := ^(torch|triton|nvidia-.*|cuda-.*)==
$(STAMP): requirements-dev.txt requirements-lock.txt | $(BIN)/python
	awk -v dir=$(VENV) '/^#/ { next } /$(HEAVY)/ { print > (dir "/lock-0.txt"); next } \
	  { print > (dir "/lock-" (1 + n++ % 2) ".txt") }' requirements-lock.txt
	pids=; for part in 0 1 2; do \
	  $(BIN)/python -m pip install -q --no-deps -r $(VENV)/lock-$$part.txt & pids="$$pids $$!"; \
	done; failed=0; for pid in $$pids; do wait $$pid || failed=1; done; \
	[ $$failed = 0 ] && $(BIN)/python -m pip check || echo "the lock did not install cleanly: resolving requirements-dev.txt"
	$(BIN)/python -m pip install -q -r requirements-dev.txt
	touch $@

# Rewrite requirements-lock.txt from a fresh resolution of requirements-dev.txt.
lock: | $(BIN)/python
	rm -rf $(VENV)/lock-venv
	$(PYTHON) -m venv $(VENV)/lock-venv
	$(VENV)/lock-venv/bin/python -m pip install -r requirements-dev.txt
	{ echo "# Every package requirements-dev.txt pulls in, at the versions last resolved: make lock"; \
	  $(VENV)/lock-venv/bin/python -m pip freeze --all --exclude-editable | grep -v '^pip=='; \
	} > requirements-lock.txt
	rm -rf $(VENV)/lock-venv
