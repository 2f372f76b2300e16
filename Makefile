# Both targets set up a fresh machine first (apt packages, CRIU 4.2.1, venv); set-up is idempotent.
PY := .venv/bin/python
PYTEST_ARGS ?=

.PHONY: setup demo test lint bench clean

setup:
	bash scripts/setup.sh

demo: setup
	$(PY) -m bunshinfork.demo
	$(PY) -m bunshinrl.demo

lint: setup
	.venv/bin/ruff check bunshinfork bunshinrl tests benchmarks

test: setup lint
	$(PY) -m pytest -ra $(PYTEST_ARGS)

bench: setup
	$(PY) benchmarks/fork_memory.py --engines copy,ksm --forks 1,2,4,8,16 --size-mib 1024 --out results

clean:
	.venv/bin/bunshin rm --all || true
	.venv/bin/bunshin gc || true

# The fork benchmark with the cow engine: in the guest kernel, since this host cannot load
# modules (about 10 minutes under TCG). Results land in results/guest/{engines,sizes}.
.PHONY: bench-guest
bench-guest: setup
	bash kernel/setup-guest.sh
	@kver=$$(cat $${BUNSHIN_CACHE:-/var/cache/bunshin}/guest/kver); \
	$(MAKE) -C kernel KDIR=/usr/src/linux-headers-$$kver
	mkdir -p results/guest
	$(PY) kernel/guest.py --mem 12288 --timeout 3000 --out $(CURDIR)/results/guest -- '\
	insmod kernel/bunshin.ko || exit 1; \
	$(CURDIR)/$(PY) benchmarks/fork_memory.py --engines copy,ksm,cow --forks 1,2,4,8,16 --size-mib 1024 \
		--settle-timeout 90 --out $$BUNSHIN_GUEST_OUT/engines && \
	$(CURDIR)/$(PY) benchmarks/fork_memory.py --engines cow --forks 1,4,16 --size-mib 256,2048 \
		--out $$BUNSHIN_GUEST_OUT/sizes'

# Compiles the module against Debian's 6.12 headers too (loaded and tested only on 6.1).
.PHONY: kernel-check
kernel-check:
	bash kernel/build-check.sh

# Boots Debian's 6.1 kernel under qemu (TCG; this host cannot load modules), loads
# kernel/bunshin.ko there and runs the cow tests; see kernel/README.md. pytest's 5
# (no cow tests collected yet) counts as success; a kernel BUG/WARNING fails the run.
GUEST_TIMEOUT ?= 3000
GUEST_MARKS ?= cow
.PHONY: test-guest
test-guest: setup
	bash kernel/setup-guest.sh
	@kver=$$(cat $${BUNSHIN_CACHE:-/var/cache/bunshin}/guest/kver); \
	if [ -f kernel/Makefile ]; then $(MAKE) -C kernel KDIR=/usr/src/linux-headers-$$kver; \
	else echo "test-guest: no kernel/Makefile yet, not building the module"; fi
	$(PY) kernel/guest.py --check-dmesg --timeout $(GUEST_TIMEOUT) --out $${BUNSHIN_CACHE:-/var/cache/bunshin}/guest/last-run -- '\
	if [ -f kernel/bunshin.ko ]; then insmod kernel/bunshin.ko || exit 1; fi; \
	BUNSHIN_TEST_BIG_MIB=64 $(CURDIR)/$(PY) -m pytest -q -m "$(GUEST_MARKS)" --durations=0 tests/ $(PYTEST_ARGS); rc=$$?; \
	[ $$rc -eq 5 ] && rc=0; exit $$rc'
