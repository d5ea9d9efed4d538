"""Writes an input-grounded workload for speculative decoding: each prompt gives a Python file of
tokenmill's own source and asks for it back with a small edit, so most of the output repeats the
input (where n-gram drafting shines, and what editing assistants do). JSONL for `--dataset`.

    python benchmarks/code_edit_dataset.py > /tmp/code_edit.jsonl
    tokenmill bench throughput --dataset /tmp/code_edit.jsonl --temperature 0 --num-prompts 1 \\
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "tokenmill"
FILES = ["core/block_pool.py", "core/kv_cache_manager.py", "worker/logits_processors.py", "engine/detokenizer.py",
         "model/layers/embedding.py", "config/fields.py", "outputs.py", "core/request.py"]
TASK = ("Below is a Python file. Rewrite the whole file, unchanged except that every function gets a one-line "
        "docstring if it has none. Output only the code.\n\n```python\n{code}```\n\nThe rewritten file:\n\n```python\n")


def main(max_chars: int = 3000, output_len: int = 256) -> None:
    for name in FILES:
        code = (ROOT / name).read_text()[:max_chars]
        print(json.dumps({"prompt": TASK.format(code=code), "output_len": output_len}))


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
