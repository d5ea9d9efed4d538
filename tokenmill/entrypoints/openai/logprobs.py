"""Logprobs in OpenAI's two wire formats: legacy completions and chat."""

from __future__ import annotations

from tokenmill.outputs import PositionLogprobs


class CompletionLogprobs:
    """Legacy format: tokens, token_logprobs, top_logprobs, text_offset (offsets into the text)."""

    def __init__(self, offset: int = 0):
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []
        self.offset = offset

    def add(self, token_ids: list[int], positions: list[PositionLogprobs | None], piece, num_top: int) -> None:
        for tid, pos in zip(token_ids, positions):
            text = piece(tid)
            self.tokens.append(text)
            self.text_offset.append(self.offset)
            self.offset += len(text)
            if pos is None:  # the first prompt token has no logprob
                self.token_logprobs.append(None)
                self.top_logprobs.append(None)
                continue
            self.token_logprobs.append(pos[tid].logprob)
            top = sorted(pos.items(), key=lambda kv: kv[1].rank)[: max(num_top, 0)]
            entry = {piece(t): lp.logprob for t, lp in top if lp.rank <= num_top}
            entry.setdefault(text, pos[tid].logprob)
            self.top_logprobs.append(entry)

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}


def chat_logprobs(token_ids: list[int], positions: list[PositionLogprobs], piece, num_top: int) -> list[dict]:
    out = []
    for tid, pos in zip(token_ids, positions):
        text = piece(tid)
        top = sorted(pos.items(), key=lambda kv: kv[1].rank)
        out.append({
            "token": text, "logprob": pos[tid].logprob, "bytes": list(text.encode("utf-8")),
            "top_logprobs": [{"token": piece(t), "logprob": lp.logprob, "bytes": list(piece(t).encode("utf-8"))}
                             for t, lp in top if lp.rank <= num_top][:num_top],
        })
    return out
