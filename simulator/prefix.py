"""The server's prefix cache (SGLang's radix cache), as far as a client can see it: how many of
a prompt's leading tokens an earlier request already left in the cache.

It keeps token prefixes in pages of PAGE tokens, each named by a hash chained over every token
before it (so a page matches only after the same whole prefix), least recently used dropped
first once the pages hold more than `capacity` tokens. A request's prompt and the answer it
makes are both kept, as SGLang keeps a finished request's whole sequence: the next turn of a
conversation, whose prompt begins with the last turn's prompt and answer, finds them.
"""

from __future__ import annotations

from collections import OrderedDict

PAGE = 16


class PrefixCache:
    """Leading-token matches against what earlier requests left, bounded by `capacity` tokens."""

    def __init__(self, capacity: int) -> None:
        self.pages = max(1, capacity // PAGE)
        self._lru: OrderedDict[int, None] = OrderedDict()

    def take(self, prompt: list[int], answer: list[int]) -> int:
        """Tokens of `prompt` found cached, then keep prompt + answer. At least the prompt's
        last token is always computed (its logits start the answer), as in SGLang."""
        cached = 0
        chain = 0
        whole = prompt + answer
        for start in range(0, len(whole) - PAGE + 1, PAGE):
            chain = hash((chain, tuple(whole[start:start + PAGE])))
            if chain in self._lru and cached == start:
                cached = start + PAGE
            self._lru[chain] = None
            self._lru.move_to_end(chain)
        while len(self._lru) > self.pages:
            self._lru.popitem(last=False)
        return min(cached, max(0, len(prompt) - 1))
