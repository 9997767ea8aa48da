"""The sim engine's prefix cache and prefill (issue 37): what a GPU engine's automatic prefix caching does
to time to first token, modelled closely enough to test cache isolation and prefix-aware routing.

As vLLM's: a prompt is cut into blocks of `BLOCK_TOKENS` tokens (the sim's tokens are words); only whole
blocks are cached; each block is keyed by a hash chained from the request's `cache_salt` through every
block before it, so a block is found only after the same salt and the same leading tokens. A lookup counts
the leading blocks found; then every whole block of the prompt is stored (or refreshed), the least recently
used ones evicted beyond `capacity` blocks. A request with `cache_prompt: false` (llama-server's field)
reads nothing, and its blocks are stored all the same, as llama-server's slot keeps them.

Prefill: the tokens not found are computed at `prefill_tokens_per_second`, one request's prefill at a time
(a GPU's compute is shared: concurrent prefills queue), so a hit shortens its own time to first token and
everyone's queue behind it.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict

BLOCK_TOKENS = 16
MAX_CACHED_BLOCKS = 1 << 20  # the most `--prefix-cache-blocks` takes: about 80 MB of hashes


def prompt_words(prompt: object) -> list[str]:
    """The sim's tokens of a prompt as its cache reads them: the words of a string; of a message list, each
    message's `content` (a list of parts: each text part's `text`) in order; of a completion's token ids,
    each id. Anything else is no words."""
    if isinstance(prompt, str):
        return prompt.split()
    out: list[str] = []
    if isinstance(prompt, list):
        for item in prompt:
            if isinstance(item, dict):
                content = item.get("content")
                if isinstance(content, str):
                    out += content.split()
                elif isinstance(content, list):
                    for part in content:
                        if isinstance(part, dict) and isinstance(part.get("text"), str):
                            out += part["text"].split()
                elif isinstance(item.get("text"), str):
                    out += item["text"].split()
            elif isinstance(item, int) and not isinstance(item, bool):
                out.append(str(item))
            elif isinstance(item, str):
                out += item.split()
    return out


class PrefixCache:
    """Block hashes, least recently used first. `capacity`: blocks kept (0: no cache)."""

    def __init__(self, capacity: int, prefill_tokens_per_second: float = 0.0):
        self.capacity = capacity
        self.rate = prefill_tokens_per_second
        self.blocks: OrderedDict[bytes, None] = OrderedDict()
        self.queries = 0  # prompt tokens looked up (vLLM's `prefix_cache_queries`, in tokens)
        self.hits = 0  # tokens found (`prefix_cache_hits`)
        self._prefill = asyncio.Lock()

    def lookup(self, salt: str | None, words: list[str], read: bool = True) -> int:
        """Tokens of `words` found cached under `salt` (whole leading blocks), then store its blocks."""
        if self.capacity <= 0:
            return 0
        h = hashlib.blake2b(("salt:" + salt if salt is not None else "").encode(), digest_size=16).digest()
        found, matching = 0, read
        for i in range(len(words) // BLOCK_TOKENS):
            block = " ".join(words[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS]).encode()
            h = hashlib.blake2b(h + block, digest_size=16).digest()
            if matching and h in self.blocks:
                found += BLOCK_TOKENS
            else:
                matching = False
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
        self.queries += len(words)
        self.hits += found
        return found

    async def prefill(self, tokens: int) -> None:
        """Compute `tokens` not found in the cache: one prefill at a time, at the prefill rate."""
        if self.rate <= 0 or tokens <= 0:
            return
        async with self._prefill:
            await asyncio.sleep(tokens / self.rate)
