"""tokenmill: an LLM inference engine and OpenAI-compatible server."""

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
