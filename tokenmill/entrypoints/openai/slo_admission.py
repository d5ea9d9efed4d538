"""`tokenmill serve --slo ttft=...,tpot=...`: on arrival, predict a request's time to first token and
the time per output token of the batch it would join, from the engine's load (plain data through
AsyncLLMEngine.load()) and the step cost model of this machine; reject it at once with 429 and
Retry-After (the predicted drain time) when it would miss the SLO, so that the requests admitted
keep meeting it. The prediction itself is planning/admission.py's, the one `simulate --admission` runs.
"""

from __future__ import annotations

import logging
import math
import time

from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.errors import SLORejectedError
from tokenmill.planning.admission import SLOAdmission

logger = logging.getLogger("tokenmill.server")

class SLOGate:
    """The `admit` callback of AsyncLLMEngine.generate under --slo."""

    def __init__(self, engine: AsyncLLMEngine, config: EngineConfig, slo: dict[str, float],
                 profile: str | None = None, margin: float = 0.9):
        from tokenmill.planning.model_spec import model_spec
        from tokenmill.planning.profile import choose_cost_model
        from tokenmill.worker.cpu_env import default_num_threads

        threads = config.parallel.num_threads or default_num_threads()
        choice = choose_cost_model(model_spec(config), config.model.torch_device.type, threads, profile,
                                   model_arg=config.model.model)
        self.engine = engine
        self.cost_description = choice.description
        self.warnings = choice.warnings
        self.predictor = SLOAdmission(choice.model, slo, config.scheduler.max_num_batched_tokens,
                                      config.scheduler.max_num_seqs, margin)
        self.admitted = self.rejected = 0
        self.rejections = None  # a Prometheus counter, once the server has its registry
        bounds = ", ".join(f"{k} {1000 * v:g} ms" for k, v in slo.items())
        logger.info("SLO admission (%s) with the %s", bounds, choice.description)

    def __call__(self, prompt_tokens: int, max_tokens: int, num_seqs: int) -> None:
        now = time.monotonic()
        p = self.predictor.predict(self.engine.load(), prompt_tokens, max_tokens, now)
        if not p.admit:
            self.rejected += 1
            if self.rejections is not None:
                self.rejections.inc()
            retry = max(1, math.ceil(p.retry_after))
            raise SLORejectedError(f"{p.reason} under the current load; retry in {retry} s", retry_after=retry)
        self.admitted += 1
        self.predictor.record(now, prompt_tokens * num_seqs)
