"""Prometheus metrics with vLLM's names under a `tokenmill:` prefix, fed by the engine's stats
after every step (on the engine thread; prometheus-client is thread-safe)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tokenmill.core.messages import SchedulerStats, SpecDecodingStats
from tokenmill.engine.stats import IterationStats, StatLogger

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
            40.0, 80.0, 160.0, 640.0)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


class PrometheusStatLogger(StatLogger):
    """Counters and histograms are fed after every step; the gauges are read at scrape time from
    `live_stats` (so an abort that empties the engine shows at once, without another step).

    With data-parallel replicas (`replica_stats` given), generation_tokens_total,
    num_requests_running and kv_cache_usage_perc are per replica, with a `replica` label (as vLLM's
    data-parallel metrics carry an engine label); the other series cover all replicas."""

    def __init__(self, model_name: str, live_stats, registry: CollectorRegistry | None = None,
                 replica_stats=None):
        self.registry = registry or CollectorRegistry()
        labels = ["model_name"]
        r, m = self.registry, {"model_name": model_name}
        self.replica_stats = replica_stats
        per_replica = range(len(replica_stats())) if replica_stats is not None else ()

        def gauge(name, doc, by_replica=None):
            if not per_replica or by_replica is None:
                return Gauge(f"tokenmill:{name}", doc, labels, registry=r).labels(**m).set_function(
                    lambda: getattr(live_stats(), name_of[name]))
            g = Gauge(f"tokenmill:{name}", doc, [*labels, "replica"], registry=r)
            for i in per_replica:
                g.labels(model_name=model_name, replica=str(i)).set_function(
                    lambda i=i: by_replica(replica_stats()[i].scheduler))
            return g

        def counter(name, doc):
            return Counter(f"tokenmill:{name}", doc, labels, registry=r).labels(**m)

        def hist(name, doc, buckets):
            return Histogram(f"tokenmill:{name}", doc, labels, buckets=buckets, registry=r).labels(**m)

        name_of = {"num_requests_running": "num_running", "num_requests_waiting": "num_waiting",
                   "kv_cache_usage_perc": "kv_cache_usage", "kv_cache_blocks_total": "kv_blocks_total"}
        gauge("num_requests_running", "Requests in the running batch.", lambda s: s.num_running)
        gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", lambda s: s.kv_cache_usage)
        gauge("kv_cache_blocks_total", "KV cache blocks in the pool.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        self.preemptions = counter("num_preemptions", "Requests preempted (KV cache exhausted).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that got a first token.")
        if per_replica:
            gen = Counter("tokenmill:generation_tokens", "Generated tokens.", [*labels, "replica"], registry=r)
            self.generation_by_replica = [gen.labels(model_name=model_name, replica=str(i)) for i in per_replica]
            self._last_generated = [0 for _ in per_replica]
        else:
            self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.success = Counter("tokenmill:request_success", "Finished requests (each of n samples) by finish reason.",
                               ["model_name", "finished_reason"], registry=r)
        self.model_name = model_name
        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", _LATENCY)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive tokens.", _ITL)
        self.e2e = hist("e2e_request_latency_seconds", "Request latency, arrival to finish.", _LATENCY)
        self.queue = hist("request_queue_time_seconds", "Time waiting before first scheduled.", _LATENCY)
        self.req_prompt = hist("request_prompt_tokens", "Prompt length of finished requests.", _TOKENS)
        self.req_gen = hist("request_generation_tokens", "Generated tokens of finished requests.", _TOKENS)
        self._last_queries = self._last_hits = self._last_preemptions = 0
        self.spec_drafts = counter("spec_decode_num_drafts", "Speculative verifications (a request's drafts).")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_per_pos = Counter("tokenmill:spec_decode_num_accepted_tokens_per_pos",
                                    "Draft tokens accepted, by position in the draft.", ["model_name", "position"],
                                    registry=r)
        self._last_spec = SpecDecodingStats()

    def record(self, sched: SchedulerStats, it: IterationStats) -> None:
        # the scheduler's counters are cumulative; Prometheus counters take increments
        self.prefix_queries.inc(sched.prefix_queries - self._last_queries)
        self.prefix_hits.inc(sched.prefix_hits - self._last_hits)
        self.preemptions.inc(sched.num_preemptions - self._last_preemptions)
        self._last_queries, self._last_hits = sched.prefix_queries, sched.prefix_hits
        self._last_preemptions = sched.num_preemptions
        if sched.spec_decoding is not None:
            self._record_spec(sched.spec_decoding)
        self.prompt_tokens.inc(it.num_prompt_tokens)
        if self.replica_stats is None:
            self.generation_tokens.inc(it.num_generation_tokens)
        else:
            for i, rs in enumerate(self.replica_stats()):
                self.generation_by_replica[i].inc(max(0, rs.generation_tokens - self._last_generated[i]))
                self._last_generated[i] = rs.generation_tokens
        for t in it.ttfts:
            self.ttft.observe(t)
        for t in it.itls:
            self.itl.observe(t)
        for f in it.finished:
            for reason in f.finish_reasons:
                self.success.labels(model_name=self.model_name, finished_reason=reason).inc()
            self.e2e.observe(f.e2e_latency)
            self.queue.observe(f.queue_time)
            self.req_prompt.observe(f.num_prompt_tokens)
            self.req_gen.observe(f.num_generation_tokens)

    def _record_spec(self, spec: SpecDecodingStats) -> None:
        last = self._last_spec
        self.spec_drafts.inc(spec.num_drafts - last.num_drafts)
        self.spec_draft_tokens.inc(spec.num_draft_tokens - last.num_draft_tokens)
        self.spec_accepted.inc(spec.num_accepted_tokens - last.num_accepted_tokens)
        before = last.num_accepted_tokens_per_pos
        for pos, n in enumerate(spec.num_accepted_tokens_per_pos):
            delta = n - (before[pos] if pos < len(before) else 0)
            if delta:
                self.spec_per_pos.labels(model_name=self.model_name, position=str(pos)).inc(delta)
        self._last_spec = spec
