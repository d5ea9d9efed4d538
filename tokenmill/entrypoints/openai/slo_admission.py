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
from tokenmill.planning.profile import CostModelChoice

logger = logging.getLogger("tokenmill.server")


def slo_cost_model(config: EngineConfig, profile: str | None = None) -> CostModelChoice:
    """The step cost model --slo predicts with. Cheap (no weights): the server calls it before it
    loads the model, so that a profile from another machine or model fails at once, with a clear
    message, and a stale one warns and falls back to the roofline before the long load. A roofline
    is measured later, by SLOGate, once the model has loaded: measured beside the core process's
    load it came out at half this machine's FLOP/s, was cached so, and rejected every request."""
    from tokenmill.planning.profile import cost_model_for

    return cost_model_for(config, profile, measure=False)[1]


class SLOGate:
    """The `admit` callback of AsyncLLMEngine.generate under --slo."""

    def __init__(self, engine: AsyncLLMEngine, config: EngineConfig, slo: dict[str, float],
                 choice: CostModelChoice, margin: float = 0.9):
        self.engine = engine
        if choice.model is None:
            from tokenmill.planning.machine import machine_of
            from tokenmill.planning.model_spec import model_spec
            from tokenmill.planning.profile import roofline_choice

            choice = roofline_choice(model_spec(config), machine_of(config), choice.warnings)
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
