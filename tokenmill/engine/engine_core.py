"""The engine core: the scheduler and the worker, one `step()` at a time.

Its inputs (EngineCoreRequest, abort ids) and outputs (EngineCoreOutputs) are plain data
(core/messages.py), and so is what the scheduler hands the runner (core/scheduler_output.py), so
the core can move to its own process without changing either side.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, wait

from tokenmill.config import EngineConfig
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.messages import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.scheduler_output import SchedulerOutput
from tokenmill.core.spec_policy import SpecPolicy
from tokenmill.engine import faults
from tokenmill.errors import EngineStepError, WorkerDiedError
from tokenmill.executor import make_executor
from tokenmill.model.loader import ModelSource
from tokenmill.model.model_config import ModelConfig
from tokenmill.planning.step_shape import shape_of

logger = logging.getLogger(__name__)

_GRAMMAR_POLL_S = 0.02  # an idle step waits this long for a compiling grammar (no busy loop)


class EngineCore:
    def __init__(self, config: EngineConfig, source: ModelSource, model_config: ModelConfig, progress=True):
        self.config = config
        self.executor = make_executor(config, source, model_config, progress=progress)
        # the in-process worker (one rank); None when the ranks are other processes
        self.worker = getattr(self.executor, "worker", None)
        self.max_model_len = self.executor.max_model_len
        self.kv = KVCacheManager(self.executor.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        sc, spec = config.scheduler, config.speculative
        self.scheduler = Scheduler(self.kv, sc.max_num_batched_tokens, sc.max_num_seqs, self.max_model_len,
                                   sc.scheduling_policy, sc.priority_aging,
                                   num_lookahead_slots=spec.num_lookahead_slots if spec.enabled else 0,
                                   spec_disable_by_batch_size=spec.disable_by_batch_size if spec.enabled else None,
                                   spec_policy=SpecPolicy(costly_tries=spec.method == "draft_model",
                                                          rows_per_request=spec.num_speculative_tokens + 1)
                                   if spec.enabled and spec.adaptive else None)
        self.num_steps = 0
        self.num_received = 0  # sequences added, reported with the stats (the front end's load)
        self._draft_seconds = 0.0  # the last step's drafting, for the step that verifies it
        self.step_times: list | None = None  # (StepShape, seconds in the executor) per step, when recording
        faults.install_core(self)  # test-only switches; nothing when unset

    @staticmethod
    def prefetch(config: EngineConfig, load: bool = True) -> None:
        """Start the slow parts that do not need the model (see Worker.prefetch)."""
        from tokenmill.worker.worker import Worker

        Worker.prefetch(config, load)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.num_received += 1
        req = Request.from_engine_core_request(request)
        if req.params.grammar is not None:  # compiles off this thread; the request waits, others run
            req.grammar_ready = self.executor.prepare_grammar(req.params.grammar)
        self.scheduler.add_request(req)

    def abort_requests(self, request_ids) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        self._drop_finished_if_idle()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def _drop_finished_if_idle(self) -> None:
        """Finished requests reach the runner with the next step; with nothing left to run there is
        no next step, so tell it now (an empty batch: no model run)."""
        if not self.scheduler.has_unfinished() and self.scheduler.has_work():
            self.executor.execute(self.scheduler.schedule())

    def shutdown(self) -> None:
        self.executor.shutdown()

    def stats(self) -> SchedulerStats:
        stats = self.scheduler.stats()
        stats.num_received = self.num_received
        return stats

    def kv_block_states(self) -> str:
        return self.kv.pool.block_states()

    def record_step_times(self, on: bool) -> list:
        """Start (or stop) recording each step's shape and executor time (calibration); returns what
        was recorded so far. Plain data: the shapes are StepShape, the times seconds."""
        recorded, self.step_times = self.step_times or [], [] if on else None
        return recorded

    def time_step(self, sched: SchedulerOutput, reps: int) -> list[float]:
        """Run one designed step (plain data, its sequences all new) `reps` times through the
        executor, on every rank, with the engine idle; the seconds of each run. The ranks then forget
        the step's sequences."""
        assert not self.scheduler.has_unfinished(), "time_step needs an idle engine"
        times = []
        try:
            for _ in range(reps):
                t = time.perf_counter()
                self.executor.execute(sched)
                times.append(time.perf_counter() - t)
        finally:
            self.executor.execute(SchedulerOutput([], [], {}, 0, [], list(sched.num_scheduled_tokens)))
        return times

    def step(self) -> EngineCoreOutputs:
        sched = self.scheduler.schedule()
        errors, self.scheduler.failed = self.scheduler.failed, {}
        if sched.is_empty:
            self.executor.execute(sched)  # no model run; drops finished requests' state
            if self.scheduler.compiling and not errors:  # nothing to run until a grammar is ready
                wait([r.grammar_ready for r in self.scheduler.compiling], _GRAMMAR_POLL_S, FIRST_COMPLETED)
            return EngineCoreOutputs([], timestamp=time.monotonic(), scheduler_stats=self.stats(), failed=errors)
        shape = shape_of(sched, self.scheduler.requests) if self.step_times is not None else None
        t0 = time.perf_counter()
        try:
            result = self.executor.execute(sched)
        except WorkerDiedError:  # fatal: the engine loop dies and reports it (/health turns 503)
            raise
        except Exception as e:
            # The batch's KV may be half written: fail its requests and forget cached blocks.
            ids = list(sched.num_scheduled_tokens)
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
            self.kv.pool.reset_prefix_cache()
            self._drop_finished_if_idle()
            logger.exception("engine step failed; aborting %d request(s)", len(ids))
            raise EngineStepError(f"engine step failed: {type(e).__name__}: {e}", ids) from e
        self.num_steps += 1
        if shape is not None:
            self.step_times.append((shape, time.perf_counter() - t0))
        num_running = len(self.scheduler.running)
        outputs = self.scheduler.update(sched, result)
        policy = self.scheduler.spec_policy
        spec = sched.scheduled_spec_decode_tokens
        if policy is not None:
            # a step's drafting is for the next step: charge it to the step that verifies the drafts,
            # except a draft model's catch-up over a prompt or tokens decoded without it (a prefill
            # after a switch: not what a step costs while speculating)
            elapsed = time.perf_counter() - t0 - result.draft_seconds + (self._draft_seconds if spec else 0.0)
            self._draft_seconds = result.draft_seconds - result.draft_prefill_seconds
            if all(n == 1 + len(spec.get(r, ())) for r, n in sched.num_scheduled_tokens.items()):
                policy.observe(num_running, bool(spec), elapsed, sum(len(o.new_token_ids) for o in outputs),
                               sched.total_num_scheduled_tokens, sum(map(len, spec.values())))
        self._drop_finished_if_idle()
        return EngineCoreOutputs(outputs, time.monotonic(), self.stats(), failed=errors)
