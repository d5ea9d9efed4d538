"""Virtual-time simulation of the engine: the real Scheduler and KVCacheManager (not copies) build
every step, the cost model says how long it takes, and the clock jumps by that much.

Open loop (requests arrive at their trace times) or closed loop (C clients, each sending its next
request when the previous one ends, as `bench serve --concurrency` does). Sampled tokens are
placeholders and never EOS, so each request produces exactly its output length (as with
`--ignore-eos`). Per-request times come out as `bench serve` records, so the summaries (TTFT, TPOT,
ITL, E2E, goodput) are computed by the same code as a real run's.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import deque
from dataclasses import dataclass

from tokenmill.bench.serve_metrics import RequestRecord, summarize
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.messages import CoreSamplingParams
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.scheduler_output import ModelRunnerOutput
from tokenmill.planning.cost_model import StepCostModel
from tokenmill.planning.step_shape import shape_of
from tokenmill.planning.workload import TraceRequest


@dataclass(frozen=True)
class SimSettings:
    num_blocks: int
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    enable_prefix_caching: bool = True
    max_model_len: int = 8192
    scheduling_policy: str = "fcfs"
    priority_aging: float = 0.0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class SimResult:
    records: list[RequestRecord]
    duration: float  # simulated seconds, first arrival to last token
    steps: int
    num_preemptions: int
    busy: float  # simulated seconds spent in steps

    def summary(self, slo: dict[str, float] | None = None) -> dict:
        out = summarize(self.records, self.duration, slo)
        out.update(steps=self.steps, num_preemptions=self.num_preemptions,
                   utilization=self.busy / self.duration if self.duration else 0.0)
        return out


class Simulation:
    def __init__(self, cost: StepCostModel, settings: SimSettings, temperature: float = 1.0, admission=None):
        self.cost = cost
        self.admission = admission  # an SLOAdmission: open-loop arrivals it rejects get a 429
        self.settings = settings
        self.params = CoreSamplingParams(temperature=temperature, ignore_eos=True)
        self.kv = KVCacheManager(settings.num_blocks, settings.block_size, settings.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, settings.max_num_batched_tokens, settings.max_num_seqs,
                                   settings.max_model_len, settings.scheduling_policy, settings.priority_aging)
        self.now = 0.0

    def _admit(self, i: int, r: TraceRequest, records: list[RequestRecord]) -> None:
        max_tokens = min(r.output_len, self.settings.max_model_len - len(r.prompt_token_ids))
        rec = RequestRecord(i, len(r.prompt_token_ids), r.output_len, sent_at=self.now,
                            prompt_tokens=len(r.prompt_token_ids), output_tokens=0, usage_reported=True)
        records[i] = rec
        if max_tokens < 1:
            rec.error, rec.status = "prompt does not fit max_model_len", 400
            return
        if self.admission is not None:
            from tokenmill.planning.admission import snapshot_of

            n = len(r.prompt_token_ids)
            if not self.admission.predict(snapshot_of(self.scheduler), n, max_tokens, self.now).admit:
                rec.error, rec.status = "rejected by SLO admission", 429
                return
            self.admission.record(self.now, n)
        self.scheduler.add_request(Request(str(i), r.prompt_token_ids, self.params, set(), max_tokens, self.now,
                                           priority=r.priority))

    def run(self, trace: list[TraceRequest], concurrency: int | None = None, stop_at: float | None = None
            ) -> SimResult:
        """Open loop when `concurrency` is None (every request needs an arrival time), else closed; a
        closed loop sends no new request after `stop_at` simulated seconds."""
        records: list[RequestRecord] = [None] * len(trace)  # type: ignore[list-item]
        if concurrency is None:
            arrivals = [(r.arrival, i) for i, r in enumerate(trace)]
            heapq.heapify(arrivals)
            backlog: deque[int] = deque()
        else:
            arrivals = []
            backlog = deque(range(len(trace)))
            for _ in range(min(concurrency, len(trace))):
                i = backlog.popleft()
                self._admit(i, trace[i], records)
        sched, steps, busy, token = self.scheduler, 0, 0.0, 1
        start = min((a for a, _ in arrivals), default=0.0)
        while arrivals or sched.has_unfinished():
            while arrivals and arrivals[0][0] <= self.now:
                _, i = heapq.heappop(arrivals)
                self._admit(i, trace[i], records)
            if not sched.has_unfinished():
                if arrivals:
                    self.now = arrivals[0][0]
                continue
            out = sched.schedule()
            if out.is_empty:  # cannot happen with requests that fit; guard against a livelock
                raise RuntimeError("the scheduler scheduled nothing with requests waiting")
            dt = self.cost.step_time(shape_of(out, sched.requests))
            self.now += dt
            busy += dt
            steps += 1
            sampled = {rid: [token] for rid, n in out.num_scheduled_tokens.items()
                       if (r := sched.requests[rid]).num_computed_tokens + n == r.num_tokens}
            for o in sched.update(out, ModelRunnerOutput(sampled_token_ids=sampled)):
                rec = records[int(o.request_id)]
                if rec.first_token_at is None:
                    rec.first_token_at = self.now
                rec.chunk_times.append(self.now)
                rec.output_tokens += len(o.new_token_ids)
                if o.finish_reason is not None:
                    rec.end_at = self.now
                    rec.status = 200
                    if backlog and (stop_at is None or self.now < stop_at):
                        i = backlog.popleft()
                        self._admit(i, trace[i], records)
        done = [r for r in records if r is not None]
        end = max((r.end_at for r in done if r.end_at is not None), default=self.now)
        return SimResult(done, max(end - start, 1e-9), steps, sched.num_preemptions, busy)
