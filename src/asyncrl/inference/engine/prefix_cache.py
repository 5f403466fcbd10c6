"""Reuse of finished sequences' KV for later prompts that start with the same tokens (embedded engine).

The next turn of a multi-turn rollout, a group's other samples arriving later, and every prompt
that shares a long system prompt (a tool schema, say) start with tokens whose keys and values the
engine has already computed. When a sequence finishes, its KV is kept here: every position but the
last token, which was sampled and never fed back. Entries are keyed by LoRA adapter, evicted least
recently used first, within a byte budget. A new prompt copies the longest common prefix it finds
into its cache row and prefills only the rest. The engine clears the store on any weight or adapter
change, since its KV belongs to the old weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncrl.inference.engine.kv_cache import SlotKVCache


@dataclass(eq=False)  # entries are compared by identity (their fields are tensors)
class _Entry:
    adapter: str | None
    tokens: torch.Tensor  # [L] int64, CPU
    keys: list[torch.Tensor]  # per layer [kv_heads, L, head_dim]
    values: list[torch.Tensor]
    nbytes: int


class PrefixCache:
    def __init__(self, budget_bytes: int, min_tokens: int = 32):
        self.budget = budget_bytes
        self.min_tokens = min_tokens
        self._entries: list[_Entry] = []  # least recently used first
        self.nbytes = 0
        self.hits = self.reused_tokens = 0

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def store(self, adapter: str | None, tokens: list[int], cache: SlotKVCache, row: int) -> None:
        """Keep the KV of `tokens` (positions 0..len-1 of cache row `row`)."""
        n = len(tokens)
        if n < self.min_tokens or cache.keys[0] is None:
            return
        keys = [k[row, :, :n] for k in cache.keys]  # views: nothing is copied unless it is kept
        values = [v[row, :, :n] for v in cache.values]
        nbytes = sum(x.numel() * x.element_size() for x in keys + values)
        if nbytes > self.budget:  # includes budget 0 (off)
            return
        t = torch.tensor(tokens, dtype=torch.long)
        for e in self._entries:  # already held inside a longer entry: nothing new to keep
            if e.adapter == adapter and len(e.tokens) >= n and torch.equal(e.tokens[:n], t):
                return
        keys, values = [k.clone() for k in keys], [v.clone() for v in values]
        self._entries.append(_Entry(adapter, t, keys, values, nbytes))
        self.nbytes += nbytes
        while self.nbytes > self.budget:
            self.nbytes -= self._entries.pop(0).nbytes

    def lookup(self, adapter: str | None, prompt: list[int]) -> tuple[_Entry, int] | None:
        """The entry sharing the longest prefix with `prompt` and that length, capped so at least the
        prompt's last token is computed (it gives the first logits); None below `min_tokens`."""
        if not self._entries or len(prompt) <= self.min_tokens:
            return None
        p = torch.tensor(prompt, dtype=torch.long)
        best, best_len = None, 0
        for e in self._entries:
            if e.adapter != adapter:
                continue
            n = min(len(e.tokens), len(p) - 1)
            differ = (e.tokens[:n] != p[:n]).nonzero()
            common = int(differ[0]) if len(differ) else n
            if common > best_len:
                best, best_len = e, common
        if best is None or best_len < self.min_tokens:
            return None
        self._entries.remove(best)
        self._entries.append(best)
        self.hits += 1
        self.reused_tokens += best_len
        return best, best_len

    @staticmethod
    def load(entry: _Entry, length: int, cache: SlotKVCache, row: int) -> None:
        """Copy the entry's first `length` positions into cache row `row`."""
        cache.write_prefix(row, [k[:, :length] for k in entry.keys], [v[:, :length] for v in entry.values])
