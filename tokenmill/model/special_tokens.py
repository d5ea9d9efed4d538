"""Special tokens found by their text, as llama.cpp does (llama-vocab.cpp): a GGUF names one EOS,
while its model also ends text with others (Qwen2.5's base `<|endoftext|>` after its instruct
`<|im_end|>`), and fill-in-the-middle prompts need the model's FIM tokens, which few files name."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# tokens that end generation wherever the model emits them
END_OF_GENERATION = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>",
    "<|end_of_text|>", "<|return|>", "<|call|>", "<end_of_utterance>",
    # FIM padding, repository and file separators: a completion that reaches one has ended its file
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<reponame>",
    "<|file_sep|>",
})

FIM_PREFIX = ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>", "▁<PRE>", "[PREFIX]")
FIM_SUFFIX = ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>", "▁<SUF>", "[SUFFIX]")
FIM_MIDDLE = ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>", "▁<MID>", "[MIDDLE]")


def end_of_generation_ids(tokens: Iterable[tuple[int, str]]) -> set[int]:
    """The ids of (id, text) pairs whose text ends generation."""
    return {i for i, text in tokens if text in END_OF_GENERATION}


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int

    def prompt(self, prefix_ids: list[int], suffix_ids: list[int]) -> list[int]:
        """Prefix-suffix-middle order (StarCoder, Qwen2.5-Coder, CodeLlama): the model writes the middle."""
        return [self.prefix, *prefix_ids, self.suffix, *suffix_ids, self.middle]


def find_fim_tokens(vocab: dict[str, int]) -> FimTokens | None:
    """The model's fill-in-the-middle tokens, or None when its vocabulary lacks one of the three."""
    found = [next((vocab[t] for t in texts if t in vocab), None) for texts in (FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE)]
    return None if None in found else FimTokens(*found)
