"""Incremental, streaming-safe detokenization with stop strings.

`tokenizers.decoders.DecodeStream` yields text only once a token completes valid UTF-8, so a
character split across tokens is never emitted broken. Stop strings are searched in a window
that spans token boundaries; while streaming, the last (longest stop - 1) characters are held back
because they may still turn out to be the start of a stop string.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from tokenmill.sampling_params import SamplingParams

_PROMPT_CONTEXT = 6  # prompt tokens fed first so the first output token decodes in context


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer  # a tokenizers.Tokenizer
        self.stream = DecodeStream(ids=prompt_token_ids[-_PROMPT_CONTEXT:],
                                   skip_special_tokens=params.skip_special_tokens)
        self.stops = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.hold_back = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.sent = 0  # characters of text already handed out as deltas

    def update(self, token_ids: list[int], skip_last: bool = False) -> str | None:
        """Append tokens' text; returns the stop string if one now appears (text is cut there).
        `skip_last`: the final token is a stop token whose text is not part of the output."""
        start = len(self.text)
        for tok in token_ids[:-1] if skip_last else token_ids:
            piece = self.stream.step(self.tokenizer, tok)
            if piece:
                self.text += piece
        if not self.stops or len(self.text) == start:
            return None
        window = max(0, start - self.hold_back)
        best = None
        for stop in self.stops:
            i = self.text.find(stop, window)
            if i != -1 and (best is None or i < best[0]):
                best = (i, stop)
        if best is None:
            return None
        i, stop = best
        self.text = self.text[: i + len(stop) if self.include_stop else i]
        return stop

    def delta(self, finished: bool) -> str:
        """New text since the last call (holding back a possible stop-string prefix unless done)."""
        end = len(self.text) if finished or not self.stops else max(self.sent, len(self.text) - self.hold_back)
        out = self.text[self.sent:end]
        self.sent = end
        return out
