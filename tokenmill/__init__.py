"""tokenmill: an LLM inference engine and OpenAI-compatible server."""

import os

# Allocations of 2 MiB and more (weights, KV cache) in transparent huge pages, as PyTorch's CPU
# allocator does when asked: a decode step streams every weight, and with 4 KiB pages the TLB misses
# cost the packed GEMV 7-18% of its bandwidth (BENCHMARKS.md, issue 8). torch reads it at its first
# allocation, so it is set before anything here imports torch; a value the user set is kept.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from tokenmill.config import EngineConfig
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams
from tokenmill.structured_output import StructuredOutputsParams

__version__ = "0.1.0"

__all__ = ["LLM", "EngineConfig", "SamplingParams", "StructuredOutputsParams", "RequestOutputKind", "RequestOutput",
           "CompletionOutput", "Logprob", "__version__"]


def __getattr__(name):
    # LLM pulls in torch and the model code; import it on first use so `import tokenmill` stays light
    if name == "LLM":
        from tokenmill.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)
