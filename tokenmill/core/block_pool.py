"""The pool of KV cache blocks: a free list in eviction order, reference counts, and the table of
cached full blocks by hash.

A block is in exactly one of: in use (ref_cnt > 0), free and cached (ref_cnt == 0, has a hash, in
the free queue, still reusable on a hit), or free and empty (ref_cnt == 0, no hash). Allocation
takes from the front of the free queue, evicting a cached block only when no empty one is left
ahead of it; empty blocks are queued at the front, cached ones at the back (least recently freed
is evicted first).
"""

from __future__ import annotations

from collections import OrderedDict


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def block_states(self) -> str:
        """One character per block, by id: "1" in use, "2" free but cached (reusable until evicted),
        "0" free and empty. Plain data for dashboards."""
        return "".join("1" if b.ref_cnt else "2" if b.block_hash is not None else "0" for b in self.blocks)

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def allocate(self, n: int) -> list[KVCacheBlock]:
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks with {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:  # evict its cached content
                del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits (a free cached block leaves the free queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks) -> None:
        """Drop a reference; pass a request's blocks tail first so its tail is evicted first."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block
                if block.block_hash is None:
                    self.free_queue.move_to_end(block.block_id, last=False)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Register a full block's content. If an equal block is already cached, keep that one."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def uncache(self, blocks) -> None:
        """Forget what these blocks were registered as (their K/V was never written)."""
        for block in blocks:
            if block.block_hash is not None and self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> int:
        """Forget every free cached block (e.g. after new weights). Returns how many."""
        n = 0
        for block in self.free_queue.values():
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash = None
                n += 1
        return n

    def check_invariants(self) -> None:
        """For tests: every block accounted for exactly once, no negative refcounts."""
        in_use = [b for b in self.blocks if b.ref_cnt > 0]
        assert all(b.ref_cnt >= 0 for b in self.blocks)
        assert len(in_use) + len(self.free_queue) == self.num_blocks
        assert all(b.ref_cnt == 0 for b in self.free_queue.values())
        assert all(self.cached[b.block_hash] is b for b in self.blocks if b.block_hash is not None)
