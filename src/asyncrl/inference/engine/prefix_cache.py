"""Reuse of finished sequences' KV for later prompts that start with the same tokens (embedded engine).

The next turn of a multi-turn rollout, a group's other samples arriving later, and every prompt
that shares a long system prompt (a tool schema, say) start with tokens whose keys and values the
engine has already computed. When a sequence finishes, its KV is kept here: every position but the
last token, which was sampled and never fed back. Entries are keyed by LoRA adapter, evicted least
recently used first, within a byte budget. A new prompt copies the longest common prefix it finds
into its cache row and prefills only the rest. The engine clears the store on any weight or adapter
change, since its KV belongs to the old weights.

Finding a prefix costs O(prompt length), not O(entries): every entry is indexed under the chained
hash of each of its full `BLOCK`-token prefixes. A lookup walks the prompt's blocks through that
index to the deepest entry holding them (checked token by token, so a hash collision is only a
miss), then extends the match token by token inside that entry. A match shorter than one block
is not found, so `min_tokens` should be at least `BLOCK`. An entry keeps the MoE routes of its positions too
when the cache records them (`SlotKVCache.routes`), and a prefix copied out brings its routes along.

New prompts admitted together share prefixes too (distinct questions after one chat header or system
prompt): `shared_prefix_groups` finds them, and the engine prefills each shared prefix once.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from asyncrl.inference.engine.kv_cache import SlotKVCache

BLOCK = 16  # tokens per indexed block


@dataclass(eq=False)  # entries are compared by identity (their fields are tensors)
class _Entry:
    adapter: str | None
    tokens: list[int]
    keys: list[torch.Tensor]  # per layer [kv_heads, L, head_dim]
    values: list[torch.Tensor]
    nbytes: int
    hashes: list[int]  # chained hash of each full block prefix
    routes: torch.Tensor | None = None  # [L, MoE layers, top_k] uint8, when the cache records routes


def block_hashes(tokens: list[int], adapter: str | None) -> list[int]:
    """Chained hash of tokens[:BLOCK], tokens[:2 * BLOCK], ... (full blocks only)."""
    out, h = [], hash(adapter)
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        h = hash((h, *tokens[start : start + BLOCK]))
        out.append(h)
    return out


def shared_prefix_groups(keys: list[tuple], min_tokens: int, min_saved: int) -> list[tuple[list[int], int]]:
    """Groups of indices into `keys` ((adapter key..., prompt tokens), the prompt last) whose prompts start
    with the same at least `min_tokens` tokens, each with that shared length, capped one short of its
    shortest prompt (a prompt's last token is always computed: it gives the first logits). Keys in sorted
    order, each group the run sharing min_tokens with its first; only groups whose sharing saves
    (members - 1) * length >= min_saved tokens."""
    order = sorted(range(len(keys)), key=keys.__getitem__)
    groups, run = [], order[:1]
    for i in order[1:]:
        if _shared(keys[run[0]], keys[i], min_tokens) == min_tokens:
            run.append(i)
        else:
            groups.append(run)
            run = [i]
    groups.append(run)
    found = [(run, _group_length(keys, run)) for run in groups if len(run) > 1]
    return [(run, n) for run, n in found if n >= min_tokens and (len(run) - 1) * n >= min_saved]


def _shared(a: tuple, b: tuple, limit: int) -> int:
    """Prompt tokens keys a and b share (at most `limit`); 0 under different adapters."""
    if a[:-1] != b[:-1]:
        return 0
    return _common(a[-1], b[-1], 0, min(limit, len(a[-1]), len(b[-1])))


def _group_length(keys: list[tuple], run: list[int]) -> int:
    """What a sorted run of keys shares (its first and last share least), one short of its shortest prompt."""
    first, last = keys[run[0]][-1], keys[run[-1]][-1]
    return min([_shared(keys[run[0]], keys[run[-1]], min(len(first), len(last)))] + [len(keys[m][-1]) - 1 for m in run])


def _common(a: list[int], b: list[int], start: int, limit: int) -> int:
    """Length of the common prefix of a and b, known equal up to `start`, at most `limit`."""
    n = start
    while n < limit and a[n] == b[n]:
        n += 1
    return n


class PrefixCache:
    def __init__(self, budget_bytes: int, min_tokens: int = 32):
        self.budget = budget_bytes
        self.min_tokens = min_tokens
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # by id, least recently used first
        self._index: dict[int, dict[int, _Entry]] = {}  # block hash -> entries holding it (insertion order)
        self.nbytes = 0
        self.hits = self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._index.clear()
        self.nbytes = 0

    def _longest(
        self, adapter: str | None, tokens: list[int], limit: int, hashes: list[int] | None = None
    ) -> tuple[_Entry | None, int]:
        """The entry sharing the longest prefix with tokens[:limit] found via the index, and that length
        (`hashes`: block_hashes(tokens[:limit], adapter), when the caller has them)."""
        best, depth = None, 0
        for k, h in enumerate(block_hashes(tokens[:limit], adapter) if hashes is None else hashes):
            bucket = self._index.get(h)
            entry = next(reversed(bucket.values())) if bucket else None
            end = (k + 1) * BLOCK
            checked = depth if entry is best else 0  # a different entry: check its whole prefix
            if entry is None or entry.tokens[checked:end] != tokens[checked:end]:
                break
            best, depth = entry, end
        if best is None:
            return None, 0
        return best, _common(best.tokens, tokens, depth, min(limit, len(best.tokens)))

    def store(self, adapter: str | None, tokens: list[int], cache: SlotKVCache, row: int) -> None:
        """Keep the KV of `tokens` (positions 0..len-1 of cache row `row`)."""
        n = len(tokens)
        if n < self.min_tokens or cache.keys[0] is None:
            return
        nbytes = n * cache.bytes_per_position()
        if nbytes > self.budget:  # includes budget 0 (off)
            return
        hashes = block_hashes(tokens, adapter)
        if self._longest(adapter, tokens, n, hashes)[1] == n:  # already held inside a longer entry
            return
        keys, values = cache.copy_out(row, n)
        routes = cache.routes[row, :n].clone() if cache.routes is not None else None
        entry = _Entry(adapter, list(tokens), keys, values, nbytes, hashes, routes)
        self._entries[id(entry)] = entry
        for h in entry.hashes:
            self._index.setdefault(h, {})[id(entry)] = entry
        self.nbytes += nbytes
        while self.nbytes > self.budget:
            self._evict(next(iter(self._entries.values())))

    def _evict(self, entry: _Entry) -> None:
        del self._entries[id(entry)]
        for h in entry.hashes:
            bucket = self._index[h]
            del bucket[id(entry)]
            if not bucket:
                del self._index[h]
        self.nbytes -= entry.nbytes

    def lookup(self, adapter: str | None, prompt: list[int]) -> tuple[_Entry, int] | None:
        """The entry sharing the longest prefix with `prompt` and that length, capped so at least the
        prompt's last token is computed (it gives the first logits); None below `min_tokens`."""
        if not self._entries or len(prompt) <= self.min_tokens:
            return None
        best, best_len = self._longest(adapter, prompt, len(prompt) - 1)
        if best is None or best_len < self.min_tokens:
            return None
        self._entries.move_to_end(id(best))
        self.hits += 1
        self.reused_tokens += best_len
        return best, best_len

    @staticmethod
    def load(entry: _Entry, length: int, cache: SlotKVCache, row: int) -> None:
        """Copy the entry's first `length` positions into cache row `row`."""
        routes = entry.routes[:length] if entry.routes is not None else None
        cache.write_prefix(row, [k[:, :length] for k in entry.keys], [v[:, :length] for v in entry.values], routes)
