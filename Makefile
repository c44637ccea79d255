# Shepherd: the two set-up commands are `make run` and `make test`.
SHELL := /bin/bash
# The venv's interpreter: the distribution's python3 when it is 3.11+ and can make a venv (Debian's and
# Ubuntu's are built with PGO and LTO, and run the node's Python ~8% cheaper than pyenv's default build,
# which has neither: README "Which Python"), else python3 from PATH. `make venv PY=...` picks another.
PY ?= $(shell for p in /usr/bin/python3 python3; do \
	$$p -c 'import sys, ensurepip, venv; sys.exit(sys.version_info < (3, 11))' 2>/dev/null && { echo $$p; exit; }; \
	done; echo python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint unit fuzz fuzz-asan bench chaos compose-test venv clean mutate

$(STAMP): pyproject.toml setup.py $(wildcard shepherd/*/*.c shepherd/*/*.h shepherd/*/*/*.c shepherd/*/*/*.h)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@# the prefix index's C modules (setup.py) want a C compiler: Debian's, when missing and we may install it
	command -v cc >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc libc6-dev >/dev/null; } || true
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

# Command 1: install and start a mock engine plus one node on embedded defaults.
run: $(STAMP)
	$(BIN)/python -m shepherd.node.devrun

# Command 2: everything the tests need, then lint, types and the whole suite.
test: $(STAMP)
	$(BIN)/ruff check shepherd tests bench chaos
	$(BIN)/ruff format --check shepherd tests bench chaos
	$(BIN)/mypy
	$(BIN)/python -m tests.services install
	@# each test starts ~250 node and engine processes: with PYTHONDONTWRITEBYTECODE set (as on these
	@# machines) every start compiled the project's modules again (~0.4 s each); compiled once, kept in the venv
	@# (--durations: the 40 slowest tests printed at the end, where the suite's time goes)
	env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=$(CURDIR)/$(VENV)/pycache $(BIN)/pytest tests --durations=40

lint: $(STAMP)
	$(BIN)/ruff check shepherd tests bench chaos
	$(BIN)/ruff format --check shepherd tests bench chaos
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/pytest tests/unit

# Fuzz the HTTP front and request parsing (tests/fuzz) with random examples for about FUZZ_SECONDS in all
# (split between the targets; `make test` runs the same targets with few, fixed examples). Failures are
# kept in .hypothesis/ and replayed first next time.
FUZZ_SECONDS ?= 300
fuzz: $(STAMP)
	SHEPHERD_FUZZ_PROFILE=fuzz FUZZ_SECONDS=$(FUZZ_SECONDS) \
	    $(BIN)/pytest tests/fuzz -q --timeout=$$(( $(FUZZ_SECONDS) + 900 ))

# The C extensions' fuzz targets (tests/fuzz/test_fuzz_native.py) and unit tests with the extensions built
# with AddressSanitizer and UBSan into $(ASAN_DIR) (the tree's own builds untouched; tests/fuzz/native_dir.py
# imports those). Python is not instrumented: libasan is preloaded, PYTHONMALLOC=malloc lets it see every
# allocation, leak detection is off (the interpreter's own). FUZZ_SECONDS as for `make fuzz`.
ASAN_DIR ?= /tmp/shepherd-asan
NATIVE_SOURCES := shepherd/policies/_prefixcore.c shepherd/proto/_kvwire.c shepherd/proto/_varint.c \
    shepherd/tokens/_pretok.c shepherd/node/observe/_otlp_spans.c shepherd/node/output/_plainstep.c \
    shepherd/node/engines/_h2fast.c
NATIVE_UNIT := tests/unit/test_native_index.py tests/unit/test_native_replica.py tests/unit/test_kv_events_native.py \
    tests/unit/test_index_turn_ends.py tests/unit/test_fast_bpe.py tests/unit/test_otlp_wire.py \
    tests/unit/test_engine_codec_wire.py tests/unit/test_plain_step.py tests/unit/test_h2fast.py
fuzz-asan: $(STAMP)
	set -e; inc=$$($(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['include'])"); \
	suf=$$($(BIN)/python -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))"); \
	for src in $(NATIVE_SOURCES); do out=$(ASAN_DIR)/$${src%.c}$$suf; mkdir -p $$(dirname $$out); \
	    cc -shared -fPIC -g -O1 -fno-omit-frame-pointer -fsanitize=address,undefined \
	        -fno-sanitize-recover=undefined -I$$inc $$src -o $$out; done
	LD_PRELOAD="$$(cc -print-file-name=libasan.so) $$(cc -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	PYTHONMALLOC=malloc PYTHONPATH=$(CURDIR) SHEPHERD_NATIVE_DIR=$(ASAN_DIR) \
	SHEPHERD_FUZZ_PROFILE=fuzz FUZZ_SECONDS=$(FUZZ_SECONDS) \
	    $(BIN)/pytest -p tests.fuzz.native_dir -q tests/fuzz/test_fuzz_native.py $(NATIVE_UNIT) \
	        --timeout=$$(( $(FUZZ_SECONDS) + 3600 ))

bench: $(STAMP)
	$(BIN)/smg-bench all

# The whole chaos suite on network namespaces (root; installs iproute2, iptables, haproxy, libfaketime).
chaos: $(STAMP)
	$(BIN)/python -m chaos.run all --install --report chaos-report.md

# Mutation testing (not part of `make test`): mutmut mutates the modules listed under [tool.mutmut] in
# pyproject.toml (stop matcher, circuit breaker, SWIM suspicion and refutation, rate-limit admission, prefix
# index match) and runs their fast unit tests against each mutant in ./mutants; then the score per module
# (exit 1 when one is under 90%). MUTATE_JOBS workers (default 2); ~1,100 mutants, over an hour on 2 busy cores.
MUTATE_JOBS ?= 2
MUTATE_TARGETS ?= 'shepherd.node.output.stop.*' 'shepherd.node.dispatch.circuit_breaker.*' \
    'shepherd.mesh.swim_suspicion.*' 'shepherd.mesh.swim_members.*ǁrefute__*' \
    'shepherd.mesh.swim_members.*ǁon_suspect__*' 'shepherd.mesh.swim_members.*ǁon_dead__*' \
    'shepherd.mesh.swim_members.*ǁstale_accusation__*' 'shepherd.mesh.ratelimit.*ǁacquire__*' \
    'shepherd.mesh.ratelimit.*ǁ_check__*' 'shepherd.mesh.ratelimit.*ǁ_fits__*' \
    'shepherd.mesh.ratelimit.*ǁ_share__*' 'shepherd.mesh.ratelimit.*ǁ_designated__*' \
    'shepherd.policies.prefix_index.*ǁmatch__*' 'shepherd.policies.prefix_index.*ǁmatch_blocks__*' \
    'shepherd.policies.prefix_index.*ǁhashes__*'
mutate: $(STAMP)
	rm -rf mutants
	$(BIN)/mutmut run --max-children $(MUTATE_JOBS) $(MUTATE_TARGETS)
	$(BIN)/mutmut results --all true | $(BIN)/python -m tests.mutation_scores --only $(MUTATE_TARGETS)

# docker-compose cluster: build images locally (no registry needed), bring it up, kill a node, check.
compose-test: $(STAMP)
	docker/compose-test.sh

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
