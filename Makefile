# cpa -- developer entry points:
#   make test     create/refresh .venv, install the compilers' system packages, run the test suite
#   make report   the same set-up, then build the HTML report (`cpa report`: notebooks run headless)
#
# .venv reuses an existing torch when $(PYTHON) already has one (--system-site-packages);
# otherwise it installs $(TORCH_PIN), the CPU build -- an unpinned `torch` would pull a
# multi-GB CUDA build. The stamp file makes a repeated `make test` skip the install.

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.cpa-installed
TORCH_PIN ?= torch==2.13.0

.PHONY: venv sysdeps test report

venv: $(STAMP)

$(STAMP): pyproject.toml
	@if [ ! -x "$(VPY)" ]; then \
	  if $(PYTHON) -c "import torch" >/dev/null 2>&1; then \
	    echo "venv: reusing the torch of $(PYTHON) (--system-site-packages)"; \
	    $(PYTHON) -m venv --system-site-packages "$(VENV)"; \
	  else \
	    echo "venv: new venv, installing $(TORCH_PIN)"; \
	    $(PYTHON) -m venv "$(VENV)"; \
	  fi; \
	fi
	@if ! "$(VPY)" -c "import torch" >/dev/null 2>&1; then \
	  "$(VPY)" -m pip install -q "$(TORCH_PIN)"; \
	fi
	"$(VPY)" -m pip install -q -e '.[test]'
	@touch "$@"

# clang-19 for the gfx942 compile-only analysis and the wave emulator (scripts/sysdeps.sh:
# apt-get where it can, else it says what to install and the tests that need it skip)
sysdeps:
	@bash scripts/sysdeps.sh

test: venv sysdeps
	@"$(VPY)" -m pytest -q; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: ERROR: pytest collected no tests (exit 5)" >&2; fi; \
	exit $$rc

report: venv sysdeps
	"$(VENV)/bin/cpa" report
