# Both targets set up a fresh machine first (apt packages, CRIU 4.2.1, venv); set-up is idempotent.
PY := .venv/bin/python
PYTEST_ARGS ?=

.PHONY: setup setup-vllm demo test lint bench clean

setup:
	bash scripts/setup.sh

# The vLLM venv too (cached under /var/cache/bunshin, shared by every checkout): the vLLM tests need it.
setup-vllm:
	bash scripts/setup.sh --vllm

# About 4 minutes after set-up on 2 cores: a workspace forked 8 ways, then a short GRPO run on real
# workspaces (python -m bunshinrl.demo --long is the whole suite, about 15 minutes).
demo: setup
	$(PY) -m bunshinfork.demo
	$(PY) -m bunshinrl.demo

lint: setup
	.venv/bin/ruff check bunshinfork bunshinrl tests benchmarks

test: setup-vllm lint
	BUNSHIN_REQUIRE_VLLM=1 $(PY) -m pytest -ra $(PYTEST_ARGS)

# E2B's own Python SDK suite against `bunshin serve` in both modes (plain HTTP in full; E2B_DOMAIN
# over TLS for the port and network files) and the npm SDK's flows; `make test` runs them too.
# tests/e2b_suite/run.py runs one mode by hand (--mode http|domain, node ids to narrow it).
.PHONY: test-e2b-suite
test-e2b-suite: setup
	$(PY) -m pytest -ra tests/test_e2b_suite.py $(PYTEST_ARGS)

bench: setup
	$(PY) benchmarks/fork_memory.py --engines copy,ksm --forks 1,2,4,8,16 --size-mib 1024 --out results

clean:
	.venv/bin/bunshin rm -af || true
	.venv/bin/bunshin gc || true

# The fork benchmark with the cow engine: in a guest kernel, since this host cannot load
# modules. Debian's 6.12 line, where ksm (PR_SET_MEMORY_MERGE, Linux 6.4) runs beside cow and
# copy, the snapshot-cost benchmark there with soft-dirty tracking, and the rollout benchmark
# reduced (bench-guest-rollouts, below) with cow sharing, after fork_latency reduced (10 runs, 3 of fork(16), no
# serve) for cow beside ksm and copy. Results land in results/guest/{fork_latency.json,engines,
# sizes,snapshots,rollouts}.
BENCH_GUEST_KERNEL ?= 6.12
# Both host cores for the guest's two vCPUs, for timings comparable with 6.1's; a text-patching
# oops under multi-threaded TCG (see kernel/guest.py) ends the run loudly, never skews it.
BENCH_TCG_THREAD ?= multi
.PHONY: bench-guest
bench-guest: setup
	BUNSHIN_GUEST_LINE=$(BENCH_GUEST_KERNEL) bash kernel/setup-guest.sh
	mkdir -p results/guest
	$(PY) kernel/guest.py --kernel $(BENCH_GUEST_KERNEL) --tcg-thread $(BENCH_TCG_THREAD) --mem 16384 --timeout 8000 \
		--out $(CURDIR)/results/guest -- '\
	insmod $$BUNSHIN_GUEST_MODULE || exit 1; \
	$(CURDIR)/$(PY) benchmarks/fork_latency.py --engines cow,ksm,copy --runs 10 --runs16 3 --no-serve \
		--out $$BUNSHIN_GUEST_OUT/fork_latency.json && \
	$(CURDIR)/$(PY) benchmarks/fork_memory.py --engines copy,ksm,cow --forks 1,2,4,8,16 --size-mib 1024 \
		--settle-timeout 180 --out $$BUNSHIN_GUEST_OUT/engines && \
	$(CURDIR)/$(PY) benchmarks/fork_memory.py --engines cow --forks 1,4,16 --size-mib 256,2048 \
		--out $$BUNSHIN_GUEST_OUT/sizes && \
	$(CURDIR)/$(PY) benchmarks/snapshot_cost.py --engines copy,ksm,cow --size-mib 1024 --dirty-mib 10 \
		--snapshots 10 --seeds 2 --forks 1,4 --out $$BUNSHIN_GUEST_OUT/snapshots && \
	$(BENCH_GUEST_ROLLOUTS)'

# The rollout line alone (issue 38's guest line: CRIU, Base and Full with cow, one seed, 2 epochs, on
# the office family): 25 minutes under TCG (1480 s on 2026-12-05), where the whole of bench-guest
# takes hours. Results in results/guest/rollouts.
# PYTHONPATH: a worktree runs its own code, not the checkout the editable install points at.
BENCH_GUEST_FAMILIES ?= office
BENCH_GUEST_ROLLOUTS = PYTHONPATH=$(CURDIR) $(CURDIR)/$(PY) benchmarks/agent_rollouts.py --quick --families $(BENCH_GUEST_FAMILIES) \
		--group-size 2 --epochs 2 --configs CRIU,Base,Full --share-engine cow --out $$BUNSHIN_GUEST_OUT/rollouts
.PHONY: bench-guest-rollouts
bench-guest-rollouts: setup
	BUNSHIN_GUEST_LINE=$(BENCH_GUEST_KERNEL) bash kernel/setup-guest.sh
	mkdir -p results/guest
	$(PY) kernel/guest.py --kernel $(BENCH_GUEST_KERNEL) --tcg-thread $(BENCH_TCG_THREAD) --mem 16384 --timeout 5400 \
		--out $(CURDIR)/results/guest -- 'insmod $$BUNSHIN_GUEST_MODULE || exit 1; $(BENCH_GUEST_ROLLOUTS)'

# Compiles the module against bookworm's newest 6.12 headers with warnings as errors.
.PHONY: kernel-check
kernel-check:
	bash kernel/build-check.sh

# Boots a Debian kernel under qemu (TCG; this host cannot load modules), loads bunshin.ko
# built for it and runs the cow tests; see kernel/README.md. GUEST_KERNEL=6.12 runs them on
# Debian's newer line (CI runs both). A kernel BUG/WARNING fails the run.
GUEST_TIMEOUT ?= 3000
GUEST_MARKS ?= cow or guest
GUEST_KERNEL ?= 6.1
# Which test files (or node ids) the guest runs: by default those holding cow- or guest-marked
# tests (a mark, or fork_support's COW parameter). Collecting the whole tree would import torch,
# transformers, Ray and verl under TCG for tests the marks then deselect. CI's 6.1 line narrows
# it to the module's own.
GUEST_TESTS ?= $(shell grep -lE 'mark\.(cow|guest)|\bCOW\b' tests/test_*.py)
.PHONY: test-guest
test-guest: setup
	BUNSHIN_GUEST_LINE=$(GUEST_KERNEL) bash kernel/setup-guest.sh
	$(PY) kernel/guest.py --kernel $(GUEST_KERNEL) --check-dmesg --timeout $(GUEST_TIMEOUT) --out $${BUNSHIN_CACHE:-/var/cache/bunshin}/guest/last-run-$(GUEST_KERNEL) -- '\
	insmod $$BUNSHIN_GUEST_MODULE || exit 1; \
	BUNSHIN_TEST_BIG_MIB=64 $(CURDIR)/$(PY) -m pytest -q -m "$(GUEST_MARKS)" --durations=0 $(GUEST_TESTS) $(PYTEST_ARGS); rc=$$?; \
	[ $$rc -eq 5 ] && rc=0; exit $$rc'
