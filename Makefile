# The two commands of the quick start: `make demo` and `make test`.
# Each target creates or refreshes .venv from the project's own files first.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Debian packages the tests drive: the brokers the suite and the bench start privately
# (redis-server, rabbitmq-server), a real headless browser, Prometheus and its promtool,
# stress-ng for `make test-under-load`, and libfaketime for the chaos rows' clock skew.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: demo test test-under-load fresh-check bench lint venv sysdeps clean soak chaos

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

sysdeps:
	@missing=""; \
	command -v redis-server >/dev/null 2>&1 || missing="$$missing redis-server"; \
	test -x /usr/lib/rabbitmq/bin/rabbitmq-server || missing="$$missing rabbitmq-server"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	command -v promtool >/dev/null 2>&1 || missing="$$missing prometheus"; \
	command -v stress-ng >/dev/null 2>&1 || missing="$$missing stress-ng"; \
	ls /usr/lib/*/faketime/libfaketime.so.1 >/dev/null 2>&1 || missing="$$missing faketime"; \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages:$$missing"; \
		$(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $$missing; \
	fi

# DEMO_ARGS: e.g. --duration 20 (the fresh-machine check); PYTEST_ARGS: e.g. a test file.
DEMO_ARGS ?=
PYTEST_ARGS ?=

demo: venv
	$(BIN)/qcluster demo $(DEMO_ARGS)

# Everything a user needs to trust the product; long soak runs are `make soak`, the chaos
# rows (docs/chaos.md) `make chaos`.
# The suite starts its own Redis and RabbitMQ (tests/brokers.py): the ones a user may run
# on 6379/5672 are never touched. Two pytest-xdist workers, each with its own brokers.
test: venv sysdeps
	$(BIN)/pytest -n 2 --dist worksteal -m "not slow and not chaos" $(PYTEST_ARGS)

# The same suite with both CPUs saturated beside it: timing must not decide a result.
test-under-load: venv sysdeps
	stress-ng --cpu 2 --quiet & stress=$$!; \
	trap 'kill $$stress 2>/dev/null; wait $$stress 2>/dev/null' EXIT INT TERM; \
	started=$$(date +%s); status=0; \
	$(BIN)/pytest -n 2 --dist worksteal -m "not slow and not chaos" $(PYTEST_ARGS) || status=$$?; \
	echo "test-under-load: exit $$status in $$(( $$(date +%s) - started )) s"; exit $$status

# A clone of this checkout in a temporary directory runs the quick start: make demo, make test.
fresh-check:
	.ci/fresh-check

soak: venv sysdeps
	$(BIN)/pytest -m slow

# Every chaos row with its full profile; tests/chaos/results/latest.md gets the table.
chaos: venv sysdeps
	rm -f tests/chaos/results/latest.jsonl; \
	QC_CHAOS_PROFILE=full QC_CHAOS_RESULTS=1 $(BIN)/pytest -m "chaos or not chaos" tests/chaos $(PYTEST_ARGS); \
	status=$$?; $(BIN)/python -m tests.chaos.report; exit $$status

lint: venv
	$(BIN)/ruff check .
	$(BIN)/mypy

bench: venv sysdeps
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) .qcluster .pytest_cache .mypy_cache .ruff_cache test-artifacts
