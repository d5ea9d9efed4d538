"""Incremental, streaming-safe detokenization with stop strings.

`tokenizers.decoders.DecodeStream` yields text only once a token completes valid UTF-8, so a
character split across tokens is never emitted broken. Stop strings are searched in a window
that spans token boundaries; while streaming, the last (longest stop - 1) characters are held back
because they may still turn out to be the start of a stop string.
"""

from __future__ import annotations

import functools
import re

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

    def update(self, token_ids: list[int], skip_last: bool = False) -> tuple[str | None, int]:
        """Append tokens' text. Returns the stop string if one now appears (the text is cut there),
        and how many of the tokens are output: up to the one whose text completes the stop string
        (a speculative step's later tokens are not). `skip_last`: the final token is a stop token
        whose text is not part of the output."""
        for n, tok in enumerate(token_ids[:-1] if skip_last else token_ids, start=1):
            start = len(self.text)
            piece = self.stream.step(self.tokenizer, tok)
            if piece:
                self.text += piece
                if self.stops and (stop := self._cut_at_stop(start)) is not None:
                    return stop, n
        return None, len(token_ids)

    def _cut_at_stop(self, start: int) -> str | None:
        """The first stop string in the text that ends past `start`, the text cut there."""
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


class TextOffsets:
    """Where each token's text starts in the decoded text (legacy logprobs' `text_offset`): the
    characters completed before it, from `start`. A character split over tokens is counted once,
    when complete, so the offsets stay those of the text (a piece decoded alone would be a U+FFFD
    each). `text`: the text the tokens came from, when known (an echoed prompt): a special token
    the tokenizer added (a BOS) is not in it, and takes no room."""

    def __init__(self, tokenizer, context_ids: list[int], skip_special_tokens: bool = True, start: int = 0,
                 text: str | None = None):
        self.tokenizer = tokenizer
        self.stream = DecodeStream(ids=context_ids[-_PROMPT_CONTEXT:], skip_special_tokens=skip_special_tokens)
        self.offset, self.text = start, text

    def next(self, token_id: int) -> int:
        at = self.offset
        piece = self.stream.step(self.tokenizer, token_id) or ""
        if self.text is None or self.text.startswith(piece, at) or not _is_special(self.tokenizer, token_id):
            self.offset += len(piece)
        return at


def _is_special(tokenizer, token_id: int) -> bool:
    added = tokenizer.get_added_tokens_decoder().get(token_id)
    return added is not None and added.special


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each of the 256 bytes (GPT-2's), inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer, token_id: int, piece: str) -> bytes:
    """A token's own bytes (chat logprobs' `bytes`): its piece's UTF-8, unless the piece is part of a
    character (decoded alone, a U+FFFD); then the bytes its vocabulary entry stands for, in byte-level
    BPE's alphabet or as a <0xNN> byte fallback."""
    if "\ufffd" not in piece:
        return piece.encode()
    entry = tokenizer.id_to_token(token_id) or ""
    if m := _BYTE_FALLBACK.fullmatch(entry):
        return bytes([int(m.group(1), 16)])
    alphabet = _byte_level_alphabet()
    if entry and all(c in alphabet for c in entry):
        return bytes(alphabet[c] for c in entry)
    return piece.encode()
