# Both targets set up a fresh machine first (apt packages, CRIU 4.2.1, venv); set-up is idempotent.
PY := .venv/bin/python
PYTEST_ARGS ?=

.PHONY: setup demo test lint bench clean

setup:
	bash scripts/setup.sh

demo: setup
	$(PY) -m bunshinfork.demo

lint: setup
	.venv/bin/ruff check bunshinfork bunshinrl tests benchmarks

test: setup lint
	$(PY) -m pytest -ra $(PYTEST_ARGS)

bench: setup
	$(PY) benchmarks/fork_memory.py --engines copy,ksm --forks 1,2,4,8,16 --size-mib 1024 --out results

clean:
	.venv/bin/bunshin rm --all || true
	.venv/bin/bunshin gc || true
