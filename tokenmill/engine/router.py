"""Which replica gets a request: prefix affinity, balanced by outstanding tokens (issue 9).

Each replica has an approximate table of the block hashes it has seen (the KV manager's own
chained hashes, core/request.py `hash_block`), bounded and least-recently-used first out. A request
goes to the replica holding the longest run of its leading block hashes; ties, and any replica
more than `overload_tokens` ahead of the least-loaded one, fall back to the least outstanding
tokens (prompt + max_tokens of the requests routed there and not yet finished). The table is a
guess: a replica may have evicted a block, which costs only a prefill, never a wrong result.

Used in process by the data-parallel client and by the standalone `tokenmill router`.
"""

from __future__ import annotations

from collections import OrderedDict

from tokenmill.core.request import hash_block

POLICIES = ("affinity", "least_load", "round_robin")


def block_hashes(token_ids: list[int], block_size: int, salt: bytes = b"") -> list[bytes]:
    """The chained hashes of every full block of a prompt, as the KV manager computes them."""
    hashes: list[bytes] = []
    for i in range(len(token_ids) // block_size):
        hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[i * block_size:(i + 1) * block_size],
                                 salt if i == 0 else b""))
    return hashes


class PrefixAffinityRouter:
    def __init__(self, num_replicas: int, block_size: int, policy: str = "affinity",
                 overload_tokens: int = 16384, table_blocks: int = 1 << 16):
        if policy not in POLICIES:
            raise ValueError(f"router policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.block_size = block_size
        self.policy = policy
        self.overload_tokens = overload_tokens
        self.table_blocks = table_blocks
        self.tables: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_replicas)]
        self.outstanding = [0] * num_replicas
        self.alive = [True] * num_replicas
        self._next = 0
        self.num_routed = 0
        self.num_affinity_hits = 0  # routed to a replica that held at least one leading block

    def route(self, token_ids: list[int], cost: int, salt: bytes = b"") -> int:
        """Pick a replica for a prompt and count `cost` outstanding tokens against it."""
        candidates = [r for r, ok in enumerate(self.alive) if ok]
        if not candidates:
            raise RuntimeError("no replica is alive")
        hashes = block_hashes(token_ids, self.block_size, salt) if self.policy == "affinity" else []
        least = min(candidates, key=lambda r: self.outstanding[r])
        if self.policy == "round_robin":
            chosen = candidates[self._next % len(candidates)]
            self._next += 1
        elif self.policy == "least_load" or not hashes:
            chosen = least
        else:
            matched = {r: self._matched(r, hashes) for r in candidates}
            chosen = max(candidates, key=lambda r: (matched[r], -self.outstanding[r]))
            if matched[chosen] and self.outstanding[chosen] - self.outstanding[least] <= self.overload_tokens:
                self.num_affinity_hits += 1
            else:
                chosen = least
        self._remember(chosen, hashes)
        self.outstanding[chosen] += cost
        self.num_routed += 1
        return chosen

    def finish(self, replica: int, cost: int) -> None:
        self.outstanding[replica] = max(0, self.outstanding[replica] - cost)

    def set_alive(self, replica: int, alive: bool) -> None:
        self.alive[replica] = alive
        if not alive:  # its cache is gone with it
            self.tables[replica].clear()
            self.outstanding[replica] = 0

    def _matched(self, replica: int, hashes: list[bytes]) -> int:
        table = self.tables[replica]
        n = 0
        for h in hashes:
            if h not in table:
                break
            n += 1
        return n

    def _remember(self, replica: int, hashes: list[bytes]) -> None:
        table = self.tables[replica]
        for h in hashes:
            table[h] = None
            table.move_to_end(h)
        while len(table) > self.table_blocks:
            table.popitem(last=False)
