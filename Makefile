# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CORE := $(VENV)/.core
STAMP := $(VENV)/.installed
# No NVIDIA GPU: the CPU build of torch; with one, PyPI's default (CUDA) build.
TORCH ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
# the partner packages (LangChain's and LlamaIndex's integration layout), installed beside rag-spec
PARTNERS := langchain-rag-spec llama-index-llms-rag-spec llama-index-retrievers-rag-spec \
	llama-index-embeddings-rag-spec rag-spec-chain-bench
# LangChain's agents (create_agent, LangGraph's prebuilt agent) on ChatLookahead
EXTRAS_langchain-rag-spec := [agents]
QUESTION ?= How do I join two path components with os.path?

.PHONY: install pull compile demo test check docs bench bench-draft bench-page gpu-check clean

# what the demo needs: torch and rag-spec's own dependencies
$(CORE): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q "$(TORCH)"
	$(BIN)/pip install --disable-pip-version-check -q -e .
	touch $@

# the rest, for the tests, the docs and the benches: the extras and the partner packages
$(STAMP): $(CORE) $(foreach p,$(PARTNERS),integrations/$(p)/pyproject.toml)
	$(BIN)/pip install --disable-pip-version-check -q -e '.[dev,docs,langchain,llamaindex,milvus,serve]' \
		$(foreach p,$(PARTNERS),-e 'integrations/$(p)$(EXTRAS_$(p))')
	touch $@

install: $(STAMP)

pull: $(CORE)  ## fetch and convert the embedded model, build the CPU kernel (once; cached)
	$(BIN)/rag-spec models pull --no-compile

compile: pull  ## compile the embedded model's decoding steps ahead of time, float32 and GGUF weights (~6 min, once per machine)
	$(BIN)/rag-spec models compile

demo: pull  ## answer a question about the standard library, citing the passages used
	$(BIN)/rag-spec ask "$(QUESTION)"

# pytest -n 2: one worker a core, one torch thread each (tests/conftest.py)
test: install compile  ## every test: tiny random models, compiled steps, servers, then the real model
	$(BIN)/ruff check rag_spec kernels integrations lab tests
	$(BIN)/python -m pytest -q -n 2

check: install  ## the inner loop (about a minute): lint, then every test but the slow and e2e ones
	$(BIN)/ruff check rag_spec kernels integrations lab tests
	$(BIN)/python -m pytest -q -n 2 -m "not slow and not e2e"

docs: install pull  ## the documentation site, executing every tutorial notebook (warnings are errors)
	$(BIN)/mkdocs build --strict

bench: install compile  ## the headline bench: the default decoder (steps compiled ahead of time) and its ablations
	$(BIN)/rag-spec bench lookahead --limit 12 --peer llama.cpp --json docs/benchmarks/lookahead.json
	$(BIN)/python -m rag_spec.bench.page

bench-draft: install pull  ## draft models and early exits vs transformers' assisted generation
	$(BIN)/rag-spec bench draft --json docs/benchmarks/draft.json
	$(BIN)/python -m rag_spec.bench.page

bench-page: install  ## docs/benchmarks/README.md and README.md's "How fast" table, from the JSON
	$(BIN)/python -m rag_spec.bench.page

# On a machine with a GPU and torch + transformers installed (no venv, no network needed):
# the Triton kernel's and CUDA graphs' tests on the GPU, then greedy identity, speculative
# sampling, speed and step costs on a random Llama-3-8B-shaped model (report: gpu-check.json).
gpu-check:
	PYTHONPATH=.:kernels:$$PYTHONPATH $(PYTHON) -m pytest -q -p no:cacheprovider -k gpu tests/test_tree_mask_attention.py tests/test_model_families.py tests/test_compiled_step.py
	PYTHONPATH=.:kernels:$$PYTHONPATH $(PYTHON) -m lab.gpu_check --json gpu-check.json

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build
