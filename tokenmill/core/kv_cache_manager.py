"""Per-request KV block bookkeeping on top of the BlockPool: prefix-cache lookups, slot allocation
as a request grows, freeing when it ends."""

from __future__ import annotations

from tokenmill.core.block_pool import BlockPool, KVCacheBlock
from tokenmill.core.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_hashed: dict[str, int] = {}  # leading blocks of a request already registered
        self.prefix_queries = 0  # tokens looked up in the prefix cache (cumulative)
        self.prefix_hits = 0  # of which served from it

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_computed_blocks(self, req: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks, leaving at least one token to compute (its logits
        are needed to sample)."""
        if not self.enable_caching or req.skip_prefix_cache:
            return [], 0
        hashes = req.update_block_hashes(self.block_size)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits = []
        for h in hashes[:max_blocks]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit

    def allocate_slots(self, req: Request, num_new_tokens: int, computed: list[KVCacheBlock] = (),
                       num_lookahead: int = 0) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens after the request's computed ones (plus
        `computed` prefix hits, on admission), and `num_lookahead` slots after them that a draft
        model writes. None if the pool cannot: the caller preempts. Only blocks full of known
        tokens are registered in the prefix cache (draft tokens are not in `req.all_token_ids`)."""
        blocks = self.req_blocks.get(req.request_id, [])
        num_after = req.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        need = -(-(num_after + num_lookahead) // self.block_size) - len(blocks) - len(computed)
        reclaimed = sum(1 for b in computed if b.ref_cnt == 0)  # hits that are free-but-cached
        if need > self.pool.num_free_blocks - reclaimed:
            return None
        self.pool.touch(list(computed))
        new = self.pool.allocate(max(need, 0))
        blocks = self.req_blocks.setdefault(req.request_id, blocks)
        blocks.extend(computed)
        blocks.extend(new)
        if self.enable_caching:
            self._cache_full_blocks(req, blocks, num_after)
        return new

    def _cache_full_blocks(self, req: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        """Register blocks that are full once this step's KV is written (an equal request admitted
        in the same step can already share them: the step writes K/V before it reads)."""
        done = self._num_hashed.get(req.request_id, 0)
        full = min(num_tokens, req.num_tokens) // self.block_size
        if full <= done or req.skip_prefix_cache:
            return
        hashes = req.update_block_hashes(self.block_size)
        for i in range(done, full):
            self.pool.cache_block(blocks[i], hashes[i])
        self._num_hashed[req.request_id] = full

    def trim(self, req: Request, num_tokens: int) -> int | None:
        """Free the blocks past the first `num_tokens` slots (e.g. those of rejected draft tokens).
        Returns the blocks kept, or None when nothing was freed."""
        blocks = self.req_blocks.get(req.request_id)
        keep = -(-num_tokens // self.block_size)
        if blocks is None or len(blocks) <= keep:
            return None
        if keep < self._num_hashed.get(req.request_id, 0):  # an engine bug, not bad input: fail loudly
            raise RuntimeError(f"trim of {req.request_id} to {num_tokens} tokens would free blocks in the "
                               "prefix cache (only rejected drafts' blocks are ever trimmed)")
        self.pool.free(reversed(blocks[keep:]))
        del blocks[keep:]
        return keep

    def free(self, req: Request, num_written: int | None = None) -> None:
        """`num_written`: when the request's part of this step is undone after `allocate_slots`
        registered the blocks that step would fill, the tokens whose K/V is really there. Blocks
        past them leave the prefix cache: a later hit would read K/V nobody wrote."""
        blocks = self.req_blocks.pop(req.request_id, [])
        num_hashed = self._num_hashed.pop(req.request_id, 0)
        if num_written is not None:
            self.pool.uncache(blocks[num_written // self.block_size:num_hashed])
        self.pool.free(reversed(blocks))

    def block_ids(self, req: Request) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(req.request_id, ())]

    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free_blocks
