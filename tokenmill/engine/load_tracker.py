"""The work an engine holds, seen from the front end: the core's last reported load plus the
sequences it had not received when it reported.

A core in another process reports its load with each step's outputs, so a report can predate
requests already sent to it. Pairing a report with what the front end had sent by then counted
those requests as taken in when they were not. Each report therefore carries how many sequences the
core had received (`SchedulerStats.num_received`, summed over data-parallel replicas); the sequences
submitted after that many are the ones the report leaves out, and they are the newest ones.
"""

from __future__ import annotations

from collections import deque

from tokenmill.core.messages import SchedulerLoad, SchedulerStats


class LoadTracker:
    def __init__(self, num_received_before: int = 0):
        """`num_received_before`: what the core had received from elsewhere (an engine used
        directly before this front end wrapped it)."""
        self._baseline = num_received_before
        self._unreported: deque[tuple[int, int]] = deque()  # (prompt, max tokens) per sequence
        self._num_submitted = 0  # sequences, counted on the event loop
        self._num_lost = 0  # sequences that never reached a core (refused there), engine thread
        self._reported: tuple[int, SchedulerLoad] = (0, SchedulerLoad())  # (received, load)

    def submitted(self, prompt_tokens: int, max_tokens: int, num_seqs: int) -> None:
        """Event loop: a request of `num_seqs` sequences is on its way to the core."""
        self._num_submitted += num_seqs
        self._unreported.extend([(prompt_tokens, max_tokens)] * num_seqs)

    def lost(self, num_seqs: int) -> None:
        """Engine thread: sequences refused before they reached a core."""
        self._num_lost += num_seqs

    def reported(self, stats: SchedulerStats) -> None:
        """Engine thread: the core's statistics, as it reported them with its last step."""
        self._reported = (stats.num_received - self._baseline + self._num_lost, stats.load)

    def load(self) -> SchedulerLoad:
        """Event loop: the reported load plus every sequence submitted after the report's count."""
        received, load = self._reported
        while self._unreported and len(self._unreported) > self._num_submitted - received:
            self._unreported.popleft()
        if not self._unreported:
            return load
        prompt = sum(p for p, _ in self._unreported)
        decode = sum(m for _, m in self._unreported)
        return SchedulerLoad(load.num_running, load.num_waiting + len(self._unreported),
                             load.running_context_tokens, load.running_prefill_tokens,
                             load.running_decode_tokens_left, load.waiting_prompt_tokens + prompt,
                             load.waiting_decode_tokens + decode)
