"""Code-generation prompts for the draft-model benchmark (issue 10's "draft model on code prompts"):
short instructions, as a user of a coding model sends them, whose answer is new code (nothing to
copy from the prompt, so n-gram lookup has little to find and the draft model must guess). Raw
text in the Qwen chat format, so an Instruct model answers with code right away."""

from __future__ import annotations

TASKS = [
    "Write a Python function `merge_intervals(intervals)` that merges overlapping intervals, with a docstring "
    "and type hints, then a few unit tests using unittest.",
    "Implement an LRU cache class in Python with get and put in O(1), using a dict and a doubly linked list. "
    "Include type hints and docstrings.",
    "Write a Python function that parses a CSV file of (date, product, quantity, price) rows and returns the "
    "total revenue per month as a dict, sorted by month. Handle malformed rows.",
    "Implement Dijkstra's shortest path algorithm in Python with heapq, for a graph given as a dict of "
    "adjacency lists with weights. Return distances and the path to a target.",
    "Write an asyncio-based Python web crawler that fetches up to N pages from a start URL with aiohttp, "
    "limits concurrency with a semaphore and stays on the same domain.",
    "Write a Python class `Matrix` supporting addition, multiplication, transpose and determinant, with "
    "operator overloading and input validation.",
    "Implement a trie in Python with insert, search, starts_with and a method listing all words with a "
    "given prefix. Add docstrings.",
    "Write a command-line tool in Python with argparse that counts lines, words and characters in files "
    "like wc, with options -l, -w, -c and support for reading stdin.",
]
TEMPLATE = ("<|im_start|>system\nYou are a helpful coding assistant.<|im_end|>\n<|im_start|>user\n{task}<|im_end|>\n"
            "<|im_start|>assistant\n")


def code_gen_prompts(n: int) -> list[str]:
    return [TEMPLATE.format(task=TASKS[i % len(TASKS)]) for i in range(n)]
