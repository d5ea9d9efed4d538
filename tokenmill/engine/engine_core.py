"""The engine core: the scheduler and the worker, one `step()` at a time.

Its inputs (core Requests, abort ids) and outputs (EngineCoreOutput) are plain data, so it can
later move to its own process without changing either side.
"""

from __future__ import annotations

import logging

from tokenmill.config import EngineConfig
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import Scheduler, SchedulerStats
from tokenmill.engine.output_processor import EngineCoreOutput
from tokenmill.errors import EngineStepError
from tokenmill.model.loader import ModelSource
from tokenmill.model.model_config import ModelConfig
from tokenmill.worker.worker import Worker

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, source: ModelSource, model_config: ModelConfig, progress=True):
        self.config = config
        self.worker = Worker(config, source, model_config, progress=progress)
        self.max_model_len = self.worker.max_model_len
        self.kv = KVCacheManager(self.worker.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs,
                                   self.max_model_len)
        self.num_steps = 0

    def add_request(self, req: Request) -> None:
        self.scheduler.add_request(req)

    def abort_requests(self, request_ids) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def kv_block_states(self) -> str:
        return self.kv.pool.block_states()

    def step(self) -> list[EngineCoreOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        try:
            result = self.worker.runner.execute(sched)
        except Exception as e:
            # The batch's KV may be half written: fail its requests and forget cached blocks.
            ids = [s.request.request_id for s in sched.scheduled]
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
            self.kv.pool.reset_prefix_cache()
            logger.exception("engine step failed; aborting %d request(s)", len(ids))
            raise EngineStepError(f"engine step failed: {type(e).__name__}: {e}", ids) from e
        self.num_steps += 1
        self.scheduler.update(sched, result.sampled)
        outs = []
        for s in sched.scheduled:
            req = s.request
            rid = req.request_id
            token = result.sampled.get(rid)
            prompt_lp = result.prompt_logprobs.get(rid)
            if token is None and prompt_lp is None and not req.is_finished:
                continue
            lp = result.logprobs.get(rid)
            outs.append(EngineCoreOutput(
                request_id=rid,
                new_token_ids=[token] if token is not None else [],
                new_logprobs=[lp] if lp is not None else None,
                prompt_logprobs=prompt_lp,
                finish_reason=req.status.finish_reason,
                stop_reason=req.stop_reason,
                num_cached_tokens=max(req.num_cached_tokens, 0),
                first_scheduled_time=req.first_scheduled_time,
                num_preemptions=req.num_preemptions,
            ))
        return outs
