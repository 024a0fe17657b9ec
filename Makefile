# The two commands of the quick start: `make demo` and `make test`.
# Each target creates or refreshes .venv from the project's own files first.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Debian packages the tests drive: a real headless browser and Prometheus' promtool.
SYSTEM_PACKAGES := chromium prometheus
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: demo test bench lint venv sysdeps clean soak

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

sysdeps:
	@missing=""; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	command -v promtool >/dev/null 2>&1 || missing="$$missing prometheus"; \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages:$$missing"; \
		$(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $$missing; \
	fi

demo: venv
	$(BIN)/qcluster demo

# Everything a user needs to trust the product; long soak/chaos runs are `make soak`.
test: venv sysdeps
	$(BIN)/pytest -m "not slow"

soak: venv sysdeps
	$(BIN)/pytest -m slow

lint: venv
	$(BIN)/ruff check .
	$(BIN)/mypy

bench: venv
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) .qcluster .pytest_cache .mypy_cache .ruff_cache test-artifacts
