"""The embedded engine's KV cache: one row ("slot") per active sequence, plus the attention masks for it.

Buffers per layer are [slots, kv_heads, capacity, head_dim]. Active sequences always occupy rows
0..B-1 (the engine compacts rows when one finishes), so a decode step attends over the view
`buf[:B, :, :L]` without gathering. Forward modes:

- prefill: new prompts as one left-padded batch [b, P]; real tokens' keys/values are scattered to
  their slots at positions start.. (start 0, or the length of a prefix already copied into the row
  from the prefix cache by `write_prefix`), and every row's last prompt token sits in the last
  column (one logits row each). With all starts 0 the forward attends over the fresh keys only;
  otherwise over each row's slot [0, max(start + length)), gathered, so the rest of a prompt sees
  its cached prefix.
- extend: one prompt longer than the prefill budget, chunk by chunk from position `start` on;
  each chunk attends over the row's cached prefix and itself.
- decode: one token per active row, written at that row's own position; the mask hides each row's
  stale tail, so rows of different lengths share one batched forward.

All modes hand the model a ready 4D mask (or a dict per layer type), so HF skips its own mask logic.

Routing record (an MoE served with `enable_return_routed_experts`): beside the KV, a uint8 buffer
[slots, capacity, layers, top_k] holds the experts each cached position was routed to (`record`, called by the
routers' hooks during the forward); every copy of a row's KV (fan-out, compaction, prefix reuse) copies its
routes too, so a row's routes always describe the forward passes that computed its KV.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.cache_utils import Cache

SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention"}
CAPACITY_ROUND = 128


class SlotKVCache(Cache):
    """A HF `Cache` whose `update` writes into per-sequence slots (see module docstring)."""

    def __init__(self, num_layers: int, dtype: torch.dtype, device: torch.device):
        super().__init__(layers=[])
        self.num_layers = num_layers
        self.dtype = dtype
        self.device = device
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.slots = 0
        self.capacity = 0
        self._mode = "decode"
        self._rows: torch.Tensor | None = None
        self._pos: torch.Tensor | None = None
        self._real: tuple[torch.Tensor, torch.Tensor] | None = None
        self._flat: dict[int, torch.Tensor] = {}
        self._batch = 0
        self._start = 0
        self._kv_len = 0
        self._gather: torch.Tensor | None = None  # prefill over cached prefixes: the slots to attend over
        self.route_shape: tuple[int, int] | None = None  # (MoE layers, top_k) when routes are recorded
        self._real_rows = 1  # prefill: input rows of the forward
        self.routes: torch.Tensor | None = None  # [slots, capacity, layers, top_k] uint8

    # ---- sizing -------------------------------------------------------------------------------
    @staticmethod
    def rounded_capacity(capacity: int) -> int:
        """Positions `ensure` allocates for a need (rounded so growth reallocates rarely)."""
        return -(-capacity // CAPACITY_ROUND) * CAPACITY_ROUND

    def ensure(self, slots: int, capacity: int) -> None:
        """Grow buffers to at least `slots` rows of `capacity` (rounded) positions; keeps contents."""
        new_slots, new_cap = max(self.slots, slots), max(self.capacity, self.rounded_capacity(capacity))
        if new_slots == self.slots and new_cap == self.capacity:
            return
        for i in range(self.num_layers):
            for store in (self.keys, self.values):
                old = store[i]
                if old is None:
                    continue
                new = old.new_zeros(new_slots, old.shape[1], new_cap, old.shape[3])
                new[: self.slots, :, : self.capacity] = old
                store[i] = new
        if self.route_shape is not None:
            grown = torch.zeros(new_slots, new_cap, *self.route_shape, dtype=torch.uint8, device=self.device)
            if self.routes is not None:
                grown[: self.slots, : self.capacity] = self.routes
            self.routes = grown
        self.slots, self.capacity = new_slots, new_cap

    def release(self) -> None:
        """Free all buffers (nothing is active)."""
        self.keys = [None] * self.num_layers
        self.values = [None] * self.num_layers
        self.routes = None
        self.slots = self.capacity = 0

    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of row `src` into row `dst` (n>1 fan-out, compaction)."""
        if src == dst or length == 0:
            return
        for store in (self.keys, self.values):
            for buf in store:
                if buf is not None:
                    buf[dst, :, :length] = buf[src, :, :length]
        if self.routes is not None:
            self.routes[dst, :length] = self.routes[src, :length]

    def move_rows(self, src: list[int], dst: list[int], length: int) -> None:
        """Copy the first `length` positions of each row src[i] into row dst[i] (compaction: one copy per
        buffer for all moves; every source is read before any destination is written)."""
        if not src or length == 0:
            return
        src_t, dst_t = torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device)
        for store in (self.keys, self.values):
            for buf in store:
                if buf is not None:  # index_copy_: an advanced-index assignment (index_put) is ~6x slower on CPU
                    head = buf[:, :, :length]
                    head.index_copy_(0, dst_t, head.index_select(0, src_t))
        if self.routes is not None:
            self.routes[dst_t, :length] = self.routes[src_t, :length]

    def bytes_per_position(self) -> int:
        """Bytes one position of a row takes over every layer's keys and values."""
        return sum(b.shape[1] * b.shape[3] * b.element_size() for b in (*self.keys, *self.values) if b is not None)

    def copy_out(self, row: int, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of row `row`'s first `length` positions: per layer [kv_heads, length, head_dim] keys and values.
        Layers of one shape are copied by one `torch.stack` (one allocation, one op: a finished sequence's copy
        for the prefix cache costs half of a clone per buffer); each layer's copy is a view into it."""
        views = [buf[row, :, :length] for buf in (*self.keys, *self.values)]
        if len({v.shape for v in views}) > 1:  # layers of different shapes
            copies = [v.clone() for v in views]
        else:
            copies = list(torch.stack(views).unbind(0))
        return copies[: self.num_layers], copies[self.num_layers :]

    def write_prefix(
        self, row: int, keys: list[torch.Tensor], values: list[torch.Tensor], routes: torch.Tensor | None = None
    ) -> None:
        """Put per-layer [kv_heads, n, head_dim] keys/values (and [n, layers, top_k] routes) at positions 0..n-1
        of `row` (prefix reuse)."""
        if self.routes is not None and routes is not None:
            self.routes[row, : routes.shape[0]] = routes
        for i in range(self.num_layers):
            for store, src in ((self.keys, keys[i]), (self.values, values[i])):
                if store[i] is None:
                    shape = (self.slots, src.shape[0], self.capacity, src.shape[2])
                    store[i] = torch.zeros(shape, dtype=src.dtype, device=self.device)
                store[i][row, :, : src.shape[1]] = src

    # ---- routing record -----------------------------------------------------------------------
    def record(self, layer: int, chosen: torch.Tensor) -> None:
        """MoE layer `layer`'s chosen experts ([tokens of this forward, top_k]) into the routes of their positions."""
        if self.routes is None:
            return
        chosen = chosen.to(torch.uint8)
        if self._mode == "extend":
            self.routes[self._batch, self._start : self._kv_len, layer] = chosen
        elif self._mode == "prefill":
            real_i, real_c = self._real
            width = chosen.shape[0] // int(self._real_rows)
            self.routes[self._rows, self._pos, layer] = chosen.view(-1, width, chosen.shape[-1])[real_i, real_c]
        else:
            self.routes[self._rows, self._pos, layer] = chosen

    def routes_of(self, row: int, length: int) -> np.ndarray | None:
        """Row `row`'s routes at positions 0..length-1 ([length, layers, top_k] uint8), None when not recorded."""
        return None if self.routes is None else self.routes[row, :length].cpu().clone().numpy()  # a copy: rows move

    # ---- per-forward modes --------------------------------------------------------------------
    def set_prefill(self, rows: torch.Tensor, pads: torch.Tensor, width: int, starts: list[int] | None = None) -> None:
        """Left-padded batch: input row i (pads[i] pad columns, then its tokens) fills slot rows[i] from
        position starts[i] on (default 0; a start > 0 means the slot already holds that prefix)."""
        cols = torch.arange(width, device=rows.device)
        real_i, real_c = (cols[None, :] >= pads[:, None]).nonzero(as_tuple=True)
        self._mode, self._rows, self._pos = "prefill", rows[real_i], real_c - pads[real_i]
        self._real_rows = rows.shape[0]
        self._real, self._flat, self._gather = (real_i, real_c), {}, None
        if starts is not None and any(starts):
            start_t = torch.tensor(starts, device=rows.device)
            self._pos = self._pos + start_t[real_i]
            self._gather, self._kv_len = rows, max(s + width - int(p) for s, p in zip(starts, pads.tolist()))

    def set_extend(self, row: int, start: int, length: int) -> None:
        """Chunked prefill: `length` tokens at positions start.. of slot `row` (over its cached prefix)."""
        self._mode, self._batch, self._start, self._kv_len = "extend", row, start, start + length

    def set_decode(self, batch: int, positions: torch.Tensor, kv_len: int) -> None:
        """Decode: row r writes its one new token at positions[r] and attends over [0, kv_len)."""
        self._mode, self._batch, self._pos, self._kv_len = "decode", batch, positions, kv_len
        self._rows, self._flat = torch.arange(batch, device=positions.device), {}

    def _flat_index(self, heads: int, device: torch.device) -> torch.Tensor:
        """Flat element index (over a [slots * heads * capacity, dim] view) of every (token, head)."""
        flat = self._flat.get(heads)
        if flat is None:
            flat = (self._rows[:, None] * heads + torch.arange(heads, device=device)) * self.capacity
            flat = self._flat[heads] = (flat + self._pos[:, None]).flatten()
        return flat

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.keys[layer_idx] is None:
            _, heads, _, dim = key_states.shape
            shape = (self.slots, heads, self.capacity, dim)
            self.keys[layer_idx] = torch.zeros(shape, dtype=key_states.dtype, device=key_states.device)
            self.values[layer_idx] = torch.zeros(shape, dtype=value_states.dtype, device=value_states.device)
        k_buf, v_buf = self.keys[layer_idx], self.values[layer_idx]
        heads, dim = k_buf.shape[1], k_buf.shape[3]
        if self._mode == "extend":
            row, start, end = self._batch, self._start, self._kv_len
            k_buf[row, :, start:end] = key_states[0]
            v_buf[row, :, start:end] = value_states[0]
            return k_buf[row : row + 1, :, :end], v_buf[row : row + 1, :, :end]
        flat = self._flat_index(heads, k_buf.device)
        if self._mode == "prefill":  # real tokens of [b, H, P, D] -> [N, H, D]
            real_i, real_c = self._real
            k_new, v_new = key_states[real_i, :, real_c], value_states[real_i, :, real_c]
        else:  # [B, H, 1, D] -> [B, H, D]
            k_new, v_new = key_states[:, :, 0], value_states[:, :, 0]
        k_buf.view(-1, dim).index_copy_(0, flat, k_new.reshape(-1, dim))
        v_buf.view(-1, dim).index_copy_(0, flat, v_new.reshape(-1, dim))
        if self._mode == "prefill":
            if self._gather is None:
                return key_states, value_states
            return k_buf[self._gather, :, : self._kv_len], v_buf[self._gather, :, : self._kv_len]
        return k_buf[: self._batch, :, : self._kv_len], v_buf[: self._batch, :, : self._kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len

    def get_max_length(self) -> int:
        return self.capacity

    def __len__(self) -> int:
        return self.num_layers


class MaskBuilder:
    """Builds the 4D masks (bool for sdpa, additive float for eager) the model receives."""

    def __init__(self, config, dtype: torch.dtype):
        self.layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
        unsupported = self.layer_types - SUPPORTED_LAYER_TYPES
        if unsupported:
            raise ValueError(
                f"the embedded engine supports attention layers {sorted(SUPPORTED_LAYER_TYPES)}, "
                f'this model has {sorted(unsupported)}; serve it with backend = "vllm"'
            )
        self.window = getattr(config, "sliding_window", None)
        self.additive = getattr(config, "_attn_implementation", "sdpa") == "eager"
        self.dtype = dtype

    def _build(self, q_pos: torch.Tensor, k_pos: torch.Tensor, allowed: torch.Tensor):
        """Masks per layer type from query/key positions (broadcastable) and the full-attention mask."""
        masks = {"full_attention": allowed}
        if "sliding_attention" in self.layer_types:
            masks["sliding_attention"] = allowed & (k_pos > q_pos - self.window)
        if self.additive:
            neg = torch.finfo(self.dtype).min
            masks = {
                k: torch.zeros(m.shape, dtype=self.dtype, device=m.device).masked_fill_(~m, neg)
                for k, m in masks.items()
            }
        if self.layer_types == {"full_attention"}:
            return masks["full_attention"]
        return masks

    def decode(self, positions: torch.Tensor, kv_len: int):
        """[B, 1, 1, L]: row r sees keys 0..positions[r] (its own token included)."""
        q = positions[:, None, None, None]
        k = torch.arange(kv_len, device=positions.device)[None, None, None, :]
        return self._build(q, k, k <= q)

    def extend(self, start: int, length: int, device: torch.device):
        """[1, 1, length, start + length]: a chunk of one prompt over its cached prefix and itself."""
        q = torch.arange(start, start + length, device=device)[None, None, :, None]
        k = torch.arange(start + length, device=device)[None, None, None, :]
        return self._build(q, k, k <= q)

    def prefill(self, pads: torch.Tensor, width: int, starts: list[int] | None = None):
        """[b, 1, P, P] over a left-padded batch: causal among a row's real tokens; a pad column
        only sees itself (a fully masked row would make sdpa return NaN). With `starts` (rows
        continuing cached prefixes): [b, 1, P, K] over slot positions 0..K-1, row i's tokens at
        positions starts[i].. seeing everything before them; a pad column sees position 0."""
        if starts is not None and any(starts):
            return self._prefill_over_prefix(pads, width, starts)
        cols = torch.arange(width, device=pads.device)
        q = (cols[None, :, None] - pads[:, None, None])[:, None]  # positions; pads are negative
        k = (cols[None, None, :] - pads[:, None, None])[:, None]
        allowed = ((k <= q) & (k >= 0)) | (cols[:, None] == cols[None, :])
        return self._build(q, k, allowed)

    def _prefill_over_prefix(self, pads: torch.Tensor, width: int, starts: list[int]):
        start_t = torch.tensor(starts, device=pads.device)
        q = (start_t[:, None] + torch.arange(width, device=pads.device)[None, :] - pads[:, None])[:, None, :, None]
        kv_len = int(q.max()) + 1
        k = torch.arange(kv_len, device=pads.device)[None, None, None, :]
        return self._build(q, k, (k <= q) | (k == 0))
