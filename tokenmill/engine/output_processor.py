"""Turns the core's per-step token outputs into RequestOutputs: incremental text, stop strings,
logprobs, n > 1 fan-in, per-request timings, and the step's statistics."""

from __future__ import annotations

from tokenmill.core.messages import SPEC_COUNTS, EngineCoreOutput, PromptLogprobs, TokenLogprobs, spec_counts
from tokenmill.engine.detokenizer import IncrementalDetokenizer, token_bytes
from tokenmill.engine.processor import ProcessedRequest
from tokenmill.engine.stats import FinishedRequestStats, IterationStats
from tokenmill.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tokenmill.sampling_params import RequestOutputKind


class _Child:
    def __init__(self, index: int, detok: IncrementalDetokenizer, want_logprobs: bool):
        self.index = index
        self.detok = detok
        self.token_ids: list[int] = []
        self.logprobs: list | None = [] if want_logprobs else None
        self.cumulative_logprob: float | None = 0.0 if want_logprobs else None
        self.finish_reason: str | None = None
        self.stop_reason = None
        self.sent_tokens = 0
        self.changed = False
        self.spec = (0, 0, 0)  # its core request's drafts, draft tokens and accepted tokens so far


class _RequestState:
    def __init__(self, p: ProcessedRequest, children: dict[str, _Child]):
        self.p = p
        self.kind = p.params.output_kind
        self.children = children
        self.unfinished = len(children)
        self.metrics = RequestMetrics(arrival_time=p.arrival_time)
        want_prompt_lp = p.params.prompt_logprobs is not None
        self.prompt_logprobs = [None] * len(p.prompt_token_ids) if want_prompt_lp else None
        self.prompt_logprobs_sent = False


class OutputProcessor:
    def __init__(self, tokenizer, stream_interval: int = 1):
        self.tokenizer = tokenizer  # Hugging Face tokenizer
        self.stream_interval = stream_interval
        self.fast = tokenizer.backend_tokenizer
        self.requests: dict[str, _RequestState] = {}
        self.child_of: dict[str, tuple[_RequestState, _Child]] = {}
        self._piece_cache: dict[int, str] = {}
        self.failed: dict[str, str] = {}  # request id -> why: detokenizing or stop-checking it raised

    def add_request(self, p: ProcessedRequest) -> None:
        children = {}
        for i, req in enumerate(p.children):
            detok = IncrementalDetokenizer(self.fast, p.prompt_token_ids, p.params)
            children[req.request_id] = _Child(i, detok, p.params.logprobs is not None)
        state = _RequestState(p, children)
        self.requests[p.request_id] = state
        for cid, child in children.items():
            self.child_of[cid] = (state, child)

    def abort(self, request_ids) -> list[str]:
        """Forget requests; returns the child ids the core must abort."""
        out = []
        for rid in request_ids:
            state = self.requests.pop(rid, None)
            if state is not None:
                for cid in state.children:
                    self.child_of.pop(cid, None)
                    out.append(cid)
        return out

    def parents_of(self, child_ids) -> list[str]:
        return list(dict.fromkeys(self.child_of[c][0].p.request_id for c in child_ids if c in self.child_of))

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def process(self, outs: list[EngineCoreOutput],
                now: float) -> tuple[list[RequestOutput], list[str], IterationStats]:
        stats = IterationStats()
        touched: dict[str, _RequestState] = {}
        to_abort: list[str] = []
        for o in outs:
            entry = self.child_of.get(o.request_id)
            if entry is None:
                continue  # aborted meanwhile
            state, child = entry
            try:
                self._process_one(o, state, child, now, stats, touched, to_abort)
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                rid = state.p.request_id
                self.failed[rid] = f"{type(e).__name__}: {e}"
                to_abort.extend(self.abort([rid]))
                touched.pop(rid, None)

        results = []
        for rid, state in touched.items():
            finished = state.unfinished == 0
            if finished:
                del self.requests[rid]
                state.metrics.finished_time = now
                stats.finished.append(self._finished_stats(state))
            try:
                out = self._make_output(state, finished)
            except Exception as e:  # noqa: BLE001 - as above: the request fails alone
                self.failed[rid] = f"{type(e).__name__}: {e}"
                to_abort.extend(self.abort([rid]))
                continue
            if out is not None:
                results.append(out)
        return results, to_abort, stats

    def take_failed(self) -> dict[str, str]:
        """Requests whose detokenization or stop-string check raised since the last call (id -> why)."""
        failed, self.failed = self.failed, {}
        return failed

    def _process_one(self, o: EngineCoreOutput, state: _RequestState, child: _Child, now: float,
                     stats: IterationStats, touched: dict, to_abort: list[str]) -> None:
        m = state.metrics
        if o.first_scheduled_time is not None and m.first_scheduled_time is None:
            m.first_scheduled_time = o.first_scheduled_time
        m.num_cached_tokens = max(m.num_cached_tokens, o.num_cached_tokens)
        m.num_preemptions = max(m.num_preemptions, o.num_preemptions)
        if o.num_drafts:
            child.spec = spec_counts(o)
            for name, total in zip(SPEC_COUNTS, map(sum, zip(*(c.spec for c in state.children.values())))):
                setattr(m, name, total)
        if o.prompt_logprobs and state.prompt_logprobs is not None:
            self._add_prompt_logprobs(state, o.prompt_logprobs)
        stop = None
        if o.new_token_ids:
            if m.first_token_time is None:
                m.first_token_time = now
                stats.ttfts.append(now - m.arrival_time)
                stats.num_prompt_tokens += len(state.p.prompt_token_ids)
            elif state.p.request_id not in touched:  # one gap per request and step (n > 1: not per sample)
                stats.itls.append(now - m.last_token_time)
            m.last_token_time = now
            stop, used = self._add_tokens(child, o)
            stats.num_generation_tokens += used
        if stop is not None:  # a stop string wins over whatever else ended the request
            child.finish_reason, child.stop_reason = "stop", stop
            if o.finish_reason is None:
                to_abort.append(o.request_id)
        elif o.finish_reason is not None:
            child.finish_reason, child.stop_reason = o.finish_reason, o.stop_reason
        if child.finish_reason is not None:
            self.child_of.pop(o.request_id, None)
            state.unfinished -= 1
        child.changed = True
        touched[state.p.request_id] = state

    def _add_tokens(self, child: _Child, o: EngineCoreOutput) -> tuple[str | None, int]:
        """Returns the stop string the new text contains, if any, and how many of the new tokens
        are output: a stop string met mid-step (speculation) drops the tokens after it."""
        stopped_on_token = o.finish_reason == "stop" and not isinstance(o.stop_reason, str)
        skip_last = stopped_on_token and not child.detok.include_stop
        stop, used = child.detok.update(o.new_token_ids, skip_last=skip_last)
        child.token_ids.extend(o.new_token_ids[:used])
        if child.logprobs is not None and o.new_logprobs:
            for lp in o.new_logprobs[:used]:
                child.logprobs.append(self._position(lp))
                child.cumulative_logprob += lp.logprobs[0]
        return stop, used

    def _position(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        ids, vals = lp.token_ids, lp.logprobs
        pos = {ids[0]: Logprob(vals[0], lp.rank, self.piece(ids[0]))}
        for r, (tid, v) in enumerate(zip(ids[1:], vals[1:]), start=1):
            if tid not in pos:
                pos[tid] = Logprob(v, r, self.piece(tid))
        return pos

    def piece_bytes(self, token_id: int) -> bytes:
        return token_bytes(self.fast, token_id, self.piece(token_id))

    def piece(self, token_id: int) -> str:
        s = self._piece_cache.get(token_id)
        if s is None:
            s = self._piece_cache[token_id] = self.fast.decode([token_id], skip_special_tokens=False)
        return s

    def _add_prompt_logprobs(self, state: _RequestState, lps: PromptLogprobs) -> None:
        for j, lp in enumerate(lps.entries):
            p = lps.first_position + j
            if p < len(state.prompt_logprobs) and state.prompt_logprobs[p] is None:
                state.prompt_logprobs[p] = self._position(lp)

    def _make_output(self, state: _RequestState, finished: bool) -> RequestOutput | None:
        kind = state.kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if kind == RequestOutputKind.DELTA and not finished and self._gathering(state):
            return None  # the new tokens stay unsent (child.changed) until the interval fills
        outputs = []
        for child in state.children.values():
            if kind == RequestOutputKind.DELTA:
                if not child.changed:
                    continue
                text = child.detok.delta(child.finish_reason is not None)
                toks = child.token_ids[child.sent_tokens:]
                lps = child.logprobs[child.sent_tokens:] if child.logprobs is not None else None
                child.sent_tokens = len(child.token_ids)
            else:
                child.detok.delta(True)
                text, toks, lps = child.detok.text, list(child.token_ids), child.logprobs
            child.changed = False
            outputs.append(CompletionOutput(child.index, text, toks, child.cumulative_logprob, lps,
                                            child.finish_reason, child.stop_reason))
        prompt_lp = None
        if state.prompt_logprobs is not None and state.metrics.first_token_time is not None:
            if kind != RequestOutputKind.DELTA or not state.prompt_logprobs_sent:
                prompt_lp = state.prompt_logprobs
                state.prompt_logprobs_sent = True
        return RequestOutput(state.p.request_id, state.p.prompt, state.p.prompt_token_ids, outputs, finished,
                             prompt_logprobs=prompt_lp, metrics=state.metrics,
                             num_cached_tokens=state.metrics.num_cached_tokens)

    def _gathering(self, state: _RequestState) -> bool:
        """Under a stream interval: no changed sample has its first token, its end, or a full
        interval of unsent tokens yet."""
        if self.stream_interval == 1:
            return False
        return not any(c.changed and (c.sent_tokens == 0 or c.finish_reason is not None
                                      or len(c.token_ids) - c.sent_tokens >= self.stream_interval)
                       for c in state.children.values())

    @staticmethod
    def _finished_stats(state: _RequestState) -> FinishedRequestStats:
        m = state.metrics
        return FinishedRequestStats(
            finish_reasons=[c.finish_reason for c in state.children.values()],
            e2e_latency=m.finished_time - m.arrival_time,
            queue_time=(m.first_scheduled_time or m.finished_time) - m.arrival_time,
            num_prompt_tokens=len(state.p.prompt_token_ids),
            num_generation_tokens=sum(len(c.token_ids) for c in state.children.values()),
            num_cached_tokens=m.num_cached_tokens,
            ttft=m.ttft,
            spec=spec_counts(m),
        )
