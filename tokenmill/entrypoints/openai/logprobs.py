"""Logprobs in OpenAI's two wire formats: legacy completions and chat."""

from __future__ import annotations

from tokenmill.engine.detokenizer import TextOffsets
from tokenmill.outputs import PositionLogprobs


class CompletionLogprobs:
    """Legacy format: tokens, token_logprobs, top_logprobs, text_offset (offsets into the text).
    Kept across a stream's chunks (`take` hands out what was added since the last one). `offsets`:
    the generated tokens'; `prompt_offsets`: an echoed prompt's, whose text keeps its special tokens."""

    def __init__(self, offsets: TextOffsets, prompt_offsets: TextOffsets | None = None):
        self.offsets, self.prompt_offsets = offsets, prompt_offsets
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add(self, token_ids: list[int], positions: list[PositionLogprobs | None], piece, num_top: int,
            prompt: bool = False) -> None:
        offsets = self.prompt_offsets if prompt else self.offsets
        for tid, pos in zip(token_ids, positions):
            text = piece(tid)
            self.tokens.append(text)
            self.text_offset.append(offsets.next(tid))
            if pos is None:  # the first prompt token has no logprob
                self.token_logprobs.append(None)
                self.top_logprobs.append(None)
                continue
            self.token_logprobs.append(pos[tid].logprob)
            entry: dict[str, float] = {}
            # by rank: where two tokens show the same text (pieces of a character: U+FFFD) the likelier stays
            for t, lp in sorted(pos.items(), key=lambda kv: kv[1].rank):
                if lp.rank <= num_top:
                    entry.setdefault(piece(t), lp.logprob)
            entry.setdefault(text, pos[tid].logprob)
            self.top_logprobs.append(entry)

    def take(self) -> dict:
        out = {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
               "text_offset": self.text_offset}
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return out


def chat_logprobs(token_ids: list[int], positions: list[PositionLogprobs], piece, piece_bytes,
                  num_top: int) -> list[dict]:
    """`piece_bytes`: a token's own bytes, which differ from its piece's where that is part of a character."""
    out = []
    for tid, pos in zip(token_ids, positions):
        top = sorted(pos.items(), key=lambda kv: kv[1].rank)
        out.append({
            "token": piece(tid), "logprob": pos[tid].logprob, "bytes": list(piece_bytes(tid)),
            "top_logprobs": [{"token": piece(t), "logprob": lp.logprob, "bytes": list(piece_bytes(t))}
                             for t, lp in top if lp.rank <= num_top][:num_top],
        })
    return out
