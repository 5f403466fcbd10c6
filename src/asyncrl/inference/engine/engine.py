"""The embedded engine: a HF causal LM (torch + transformers) with continuous batching on CPU or CUDA.

One background thread owns the model. Each loop iteration it (1) runs queued control operations
(weight swaps, adapter loads) — so no forward ever mixes weights, (2) admits waiting requests that
fit the batch and KV budget and prefills their prompts together in one packed forward, (3) runs one
decode step for every active sequence, then hands each request its new tokens (a non-streaming
request gets each sequence once, when it finishes). Sequences in flight during a weight swap keep
their KV cache and continue with the new weights from the next step.
While requests are still arriving (an RL batch lands over some ms of HTTP), admission waits for the
burst to end (2 ms without an arrival, 20 ms at most), so requests sent together prefill together.
Identical prompts admitted together prefill once and copy the KV row. A prompt that starts with
tokens a finished sequence already computed (the next turn of a conversation, a shared system
prompt) copies that KV from the prefix cache and prefills only the rest, in the same batch; so do
distinct new prompts that start alike (a chat header, a system prompt), after their shared prefix
is prefilled once. On CPU a step's prefill runs as forwards of at most CPU_FORWARD_TOKENS tokens.
A request that asks for prompt logprobs (a distillation teacher's scoring) goes the same way, but its
prompt is prefilled whole (no prefix cache: every position's logits are needed), in batches of its own
that keep all logits, at most `score_tokens` tokens a forward (scoring.py); it leaves no prefix entry.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import os
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from loguru import logger

from asyncrl.config.inference import InferenceConfig
from asyncrl.core.errors import UserError, model_hint
from asyncrl.inference.api.backend import Backend, PromptLogprobs, SamplingParams, SeqDelta
from asyncrl.inference.api.errors import InvalidRequest
from asyncrl.inference.engine.attention import use_gqa_sdpa
from asyncrl.inference.engine.dense_forward import DenseForward
from asyncrl.inference.engine.kv_cache import MaskBuilder, SlotKVCache
from asyncrl.inference.engine.lora import LoraAdapter, LoraManager, read_adapter
from asyncrl.inference.engine.prefix_cache import PrefixCache, shared_prefix_groups
from asyncrl.inference.engine.sampling import RowSampler, sample
from asyncrl.inference.engine.scoring import score, score_token_cap
from asyncrl.inference.engine.sequence import FastDecode, Sequence
from asyncrl.inference.engine.weight_loading import load_matching_weights, loaded_fingerprints, staged, swap_in
from asyncrl.transport.routes import RoutingShape, routers

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_SEED_STRIDE = 1_000_003  # seeds of the n sequences of one seeded request: seed + i * stride
_BURST_QUIET_S = 0.002  # admission waits until no request arrived for this long ...
_BURST_MAX_S = 0.02  # ... but never longer than this per step
CPU_FORWARD_TOKENS = 1024  # prompt tokens per prefill forward on CPU (forward_token_cap)
SHARE_MIN_TOKENS = 8  # new prompts sharing a prefix this long prefill it once ...
SHARE_MIN_SAVED = 256  # ... when that saves at least this many prompt tokens


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    lora: LoraAdapter | None
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    reserve: int  # context positions each of its sequences may reach
    stream: bool = True  # False: deliver each sequence once, when it finishes
    seqs: list[Sequence] = field(default_factory=list)
    aborted: bool = False

    @property
    def adapter(self) -> str | None:
        """Its LoRA adapter's name (None: the base model)."""
        return self.lora.name if self.lora else None

    @property
    def scoring(self) -> bool:
        """Whether it asked for prompt logprobs."""
        return self.params.prompt_logprobs is not None

    @property
    def key(self) -> tuple:
        """Requests with the same key prefill once (and score once)."""
        return (self.adapter, self.params.prompt_logprobs, *self.prompt_ids)


@dataclass
class _Active:
    """An active sequence occupying cache row `row`."""

    seq: Sequence
    req: _Request
    sampler: RowSampler
    weights_version: int  # its KV is reusable only if no weight swap happened while it ran


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("device = 'cuda' but no CUDA GPU is visible; use --device cpu (or auto)")
    return torch.device(name)


def _model_dir(name: str) -> Path:
    """Local dir of the model's files (for reload_weights); hub ids resolve to the local HF cache."""
    if Path(name).is_dir():
        return Path(name)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(name, allow_patterns=["*.safetensors", "*.json"], local_files_only=True))


def _set_threads(config: InferenceConfig, device: torch.device) -> None:
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    elif device.type == "cpu":
        # leave a core to the HTTP side (event loop, JSON, tokenization): spinning torch threads on
        # every core starve it and slow the whole server down
        torch.set_num_threads(max(1, min(torch.get_num_threads(), (os.cpu_count() or 2) - 1)))


def no_cudnn_attention(device: torch.device) -> bool:
    """Take cuDNN out of SDPA's backends on a CUDA device (True when it did). Decoding gives attention a new
    shape every step (one more KV position) and cuDNN builds an execution plan per new shape (~0.1-0.4 s): the
    GPU acceptance run measured the engine at 400 tokens/s in float16 (cuDNN-eligible) against 6,089 in float32
    (not eligible), 64 clients on an H100. Flash and memory-efficient attention need no per-shape plan."""
    if device.type != "cuda":
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    return True


def auto_dtype(checkpoint: torch.dtype | None, device: torch.device, bf16_ok: bool = True) -> tuple[torch.dtype, str]:
    """What `dtype = "auto"` loads, and why. On a CUDA GPU, PRIME-RL's rule (vLLM's `--dtype auto`): float16 for
    a float32 or float16 checkpoint, bfloat16 for a bfloat16 one (float16 where the GPU has no bfloat16). Elsewhere
    float32, whatever the checkpoint: CPU half-precision matmuls are slow and lose accuracy."""
    ckpt = checkpoint if checkpoint in (torch.float16, torch.bfloat16) else torch.float32  # absent: HF's float32
    name = str(ckpt).removeprefix("torch.")
    if device.type != "cuda":
        return torch.float32, f"{name} checkpoint on {device.type}: float32 (half precision is slow and inexact there)"
    if ckpt == torch.bfloat16 and bf16_ok:
        return torch.bfloat16, "bfloat16 checkpoint: bfloat16"
    if ckpt == torch.bfloat16:
        return torch.float16, "bfloat16 checkpoint on a GPU without bfloat16: float16"
    return torch.float16, f"{name} checkpoint: float16"


def _checkpoint_dtype(name: str, kw: dict) -> torch.dtype | None:
    """The dtype a checkpoint's config.json names (None: it names none, or no config to read)."""
    from transformers import AutoConfig

    try:
        named = getattr(AutoConfig.from_pretrained(name, **kw), "dtype", None)
    except (OSError, ValueError):
        return None  # loading the model says what is wrong
    if isinstance(named, str):
        named = getattr(torch, named, None)
    return named if isinstance(named, torch.dtype) else None


def _auto_dtype_of(name: str, device: torch.device, kw: dict) -> torch.dtype:
    bf16_ok = device.type == "cuda" and torch.cuda.is_bf16_supported()
    dtype, why = auto_dtype(_checkpoint_dtype(name, kw), device, bf16_ok)
    logger.info(f"dtype auto: {why}")
    return dtype


def _load(config: InferenceConfig, device: torch.device):
    """(server tokenizer, engine-thread tokenizer, model on device); fast tokenizers aren't thread-safe."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    mcfg = config.model
    kw = dict(trust_remote_code=mcfg.trust_remote_code)
    dtype = _DTYPES.get(mcfg.dtype) or _auto_dtype_of(mcfg.name, device, kw)
    try:
        tokenizers = [AutoTokenizer.from_pretrained(mcfg.name, **kw) for _ in range(2)]
        try:
            model = AutoModelForCausalLM.from_pretrained(mcfg.name, dtype=dtype, attn_implementation="sdpa", **kw)
        except ValueError:  # an architecture without sdpa support
            model = AutoModelForCausalLM.from_pretrained(mcfg.name, dtype=dtype, attn_implementation="eager", **kw)
    except OSError as e:
        raise UserError(f"cannot load model '{mcfg.name}': {str(e).splitlines()[0]} ({model_hint(mcfg.name)})") from e
    return tokenizers[0], tokenizers[1], model.to(device).eval()


def _eos_ids(name: str, model, tokenizer) -> set[int]:
    """The generation config's eos ids (often several) plus the tokenizer's."""
    from transformers import GenerationConfig

    try:
        gen_eos = GenerationConfig.from_pretrained(name).eos_token_id
    except OSError:
        gen_eos = model.config.eos_token_id
    eos: set[int] = set()
    for ids in (gen_eos, tokenizer.eos_token_id):
        eos |= set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    return eos


def _in_the_background() -> None:
    """The weights thread's set-up: one torch thread (a per-thread setting under OpenMP), nice 10 (per thread)."""
    torch.set_num_threads(1)
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except OSError:  # not permitted here: the torch setting alone
        pass


class EmbeddedEngine(Backend):
    def __init__(self, config: InferenceConfig):
        mcfg = config.model
        self.config = config
        self.device = resolve_device(config.device)
        _set_threads(config, self.device)
        no_cudnn_attention(self.device)
        self.tokenizer, engine_tokenizer, self.model = _load(config, self.device)
        self._decoder = FastDecode(engine_tokenizer)  # the engine thread's own: fast tokenizers aren't thread-safe
        self._weights_thread = concurrent.futures.ThreadPoolExecutor(1, "asyncrl-weights", _in_the_background)
        use_gqa_sdpa(self.model, self.device)
        self.dtype = next(self.model.parameters()).dtype
        self.model_name = mcfg.name
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        limit = getattr(self.model.config, "max_position_embeddings", None) or 2048
        if mcfg.max_model_len is not None and mcfg.max_model_len > limit:
            raise UserError(f"max_model_len {mcfg.max_model_len} exceeds the model's max_position_embeddings {limit}")
        self.max_model_len = mcfg.max_model_len or limit
        try:
            self.masks = MaskBuilder(self.model.config, self.dtype)
        except ValueError as e:
            raise UserError(str(e)) from e
        self.eos_ids = _eos_ids(mcfg.name, self.model, self.tokenizer)

        self.cache = SlotKVCache(self.model.config.num_hidden_layers, self.dtype, self.device)
        if config.enable_return_routed_experts:
            self._record_routes()
        self.dense = DenseForward.for_model(self.model, self.device)  # None: every forward is HF's
        self.prefix = PrefixCache(int(config.prefix_cache_gb * 2**30))
        self._weights_version = 0
        self.lora = LoraManager(self.model)
        self.max_batch_size = config.max_batch_size
        self.max_prefill_tokens = max(config.max_prefill_tokens, 1)
        self.score_tokens = score_token_cap(self.vocab_size, self.max_prefill_tokens)
        self.forward_tokens = forward_token_cap(self.device, self.max_prefill_tokens)
        self.kv_budget = self._kv_budget_bytes(config.kv_cache_gb, config.gpu_memory_utilization)
        self._bytes_per_token = self._estimate_bytes_per_token()
        self._logits_to_keep = "logits_to_keep" in inspect.signature(self.model.forward).parameters

        self._waiting: deque[_Request] = deque()
        self._active: list[_Active] = []
        self._ops: deque[tuple[Callable[[], object], concurrent.futures.Future]] = deque()
        self._wake = threading.Condition()
        self._stop = False
        self._last_arrival = 0.0
        self._thread: threading.Thread | None = None
        logger.info(
            f"embedded engine: {mcfg.name} on {self.device} ({self.dtype}), max_model_len={self.max_model_len}, "
            f"max_batch_size={self.max_batch_size}, kv budget {self.kv_budget / 2**30:.2f} GiB"
        )

    def _record_routes(self) -> None:
        """Hook every MoE router so each forward writes its chosen experts into the cache's routes."""
        fix = "drop it (and router_replay) for a dense model"
        shape = RoutingShape.required(self.model, "enable_return_routed_experts", self.model_name, fix)
        self.cache.route_shape = (shape.layers, shape.top_k)
        for layer, router in enumerate(routers(self.model)):
            router.register_forward_hook(lambda _m, _i, out, layer=layer: self.cache.record(layer, out[-1]))
        logger.info(f"recording MoE routes: {shape.layers} layers x top-{shape.top_k} of {shape.experts} experts")

    # ---- sizing ---------------------------------------------------------------------------------
    def _kv_budget_bytes(self, gb: float | None, utilization: float | None) -> int:
        if gb is None and self.device.type == "cuda":
            return kv_budget_on_gpu(*torch.cuda.mem_get_info(self.device), utilization)
        return int((gb or 4) * 2**30)

    def _estimate_bytes_per_token(self) -> int:
        cfg = self.model.config
        heads = getattr(cfg, "num_attention_heads", 1)
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return 2 * cfg.num_hidden_layers * kv_heads * head_dim * self.dtype.itemsize

    def _kv_bytes(self, slots: int, positions: int) -> int:
        """Bytes of the KV buffers the cache allocates for this many slots x positions."""
        return slots * SlotKVCache.rounded_capacity(min(positions, self.max_model_len)) * self._bytes_per_token

    # ---- public API (event loop side) -------------------------------------------------------
    async def start(self) -> None:
        if self._thread is None:
            self._stop = False  # a shut-down engine can start again (its prefix cache kept)
            if self.config.seed is not None:
                torch.manual_seed(self.config.seed)
            self._thread = threading.Thread(target=self._run, name="embedded-engine", daemon=True)
            self._thread.start()

    async def shutdown(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
            self._thread = None

    def is_healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def lora_names(self) -> list[str]:
        return list(self.lora.adapters)

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, lora_name: str | None = None, stream: bool = True
    ) -> AsyncIterator[SeqDelta]:
        lora = None
        if lora_name is not None:
            lora = self.lora.adapters.get(lora_name)
            if lora is None:
                raise InvalidRequest(f"unknown LoRA adapter '{lora_name}'", param="model", status=404)
        reserve = min(len(prompt_ids) + params.max_tokens, self.max_model_len)
        if params.n > self.max_batch_size:
            raise InvalidRequest(f"n={params.n} exceeds the server's max_batch_size {self.max_batch_size}", "n")
        need = self._kv_bytes(params.n, reserve)
        if need > self.kv_budget:
            raise InvalidRequest(
                f"this request needs {need / 2**30:.2f} GiB of KV cache (n={params.n} x {reserve} tokens), more "
                f"than the engine's {self.kv_budget / 2**30:.2f} GiB; lower max_tokens or n, or raise kv_cache_gb",
                param="max_tokens",
            )
        loop = asyncio.get_running_loop()
        req = _Request(list(prompt_ids), params, lora, loop, asyncio.Queue(), reserve, stream)
        with self._wake:
            self._waiting.append(req)
            self._last_arrival = time.monotonic()
            self._wake.notify()
        return _RequestStream(self, req)

    def _abort(self, req: _Request) -> None:
        req.aborted = True  # the engine drops it at the next step boundary
        with self._wake:
            self._wake.notify()

    async def update_weights(self, weight_dir: str) -> dict[str, str]:
        """Read, check and convert the dir's tensors off the engine thread; swap them in between two decode steps."""
        tensors = await self._aside(load_matching_weights, weight_dir, self.model)
        ready = await self._aside(staged, self.model, tensors)
        await self._run_op(lambda: swap_in(self.model, ready))
        logger.info(f"loaded weights from {weight_dir}")
        return await self._aside(loaded_fingerprints, self.model, tensors)  # the weights lock is held

    async def reload_weights(self) -> None:
        base = await asyncio.to_thread(_model_dir, self.model_name)
        tensors = await self._aside(load_matching_weights, base, self.model, False)
        ready = await self._aside(staged, self.model, tensors)
        await self._run_op(lambda: swap_in(self.model, ready))
        logger.info(f"reloaded base weights from {base}")

    async def _aside(self, fn, *args):
        """`fn(*args)` in the weights thread: one torch thread at a lower OS priority, so that reading, checking
        and converting weights leaves the cores to decoding (on two cores they stalled it ~80 ms an update)."""
        return await asyncio.get_running_loop().run_in_executor(self._weights_thread, fn, *args)

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, str]:
        adapter = await self._aside(read_adapter, lora_name, lora_path, self.model)
        await self._run_op(lambda: self.lora.add(adapter))
        logger.info(f"loaded LoRA adapter '{lora_name}' from {lora_path}")
        return adapter.fingerprints

    async def unload_lora_adapter(self, lora_name: str) -> None:
        await self._run_op(lambda: self._unload(lora_name))
        logger.info(f"unloaded LoRA adapter '{lora_name}'")

    def _unload(self, lora_name: str) -> None:
        """Engine thread, between steps: drop the adapter, unless requests still use it (409)."""
        with self._wake:
            waiting = list(self._waiting)
        using = sum(r.adapter == lora_name for r in [*waiting, *(a.req for a in self._active)])
        if using:
            raise InvalidRequest(
                f"LoRA adapter '{lora_name}' serves {using} request(s) now: unload it once they are done",
                param="lora_name",
                status=409,
            )
        self.lora.remove(lora_name)

    async def _run_op(self, fn: Callable[[], object]) -> object:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._wake:
            self._ops.append((fn, fut))
            self._wake.notify()
        return await asyncio.wrap_future(fut)

    # ---- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._wake:
                    while not (self._stop or self._ops or self._waiting or self._active):
                        self._wake.wait()
                    self._await_burst()
                    if self._stop:
                        break
                    ops = list(self._ops)
                    self._ops.clear()
                for fn, fut in ops:
                    self._weights_version += 1  # every op changes weights or adapters: stored KV is stale
                    self.prefix.clear()
                    try:
                        fut.set_result(fn())
                    except BaseException as e:  # noqa: BLE001 - handed to the waiting request
                        fut.set_exception(e)
                admitted: list[_Request] = []
                try:
                    self._drop_aborted()
                    admitted = self._admit()
                    if admitted:
                        self._prefill(admitted)
                    if self._active:
                        self._decode()
                except Exception as e:  # noqa: BLE001 - one bad step must not kill the server
                    logger.exception("engine step failed; failing the requests in flight")
                    self._fail_all(e, admitted)
        self._fail_all(RuntimeError("the inference engine shut down"), list(self._waiting))

    def _await_burst(self) -> None:
        """Holding `_wake`: while requests are still arriving (an RL batch or a group sent over HTTP
        lands over some ms) and the batch has room, wait until they stop (bounded), so they are
        admitted and prefilled together and the event loop parses them without the engine competing
        for the GIL."""
        deadline = time.monotonic() + _BURST_MAX_S
        while self._waiting and not (self._stop or self._ops):
            now = time.monotonic()
            quiet_left = self._last_arrival + _BURST_QUIET_S - now
            wanted = len(self._active) + sum(r.params.n for r in self._waiting)
            if quiet_left <= 0 or now >= deadline or wanted >= self.max_batch_size:
                return
            self._wake.wait(min(quiet_left, deadline - now))

    def _fail_all(self, error: BaseException, more: list[_Request] = ()) -> None:
        reqs = {id(r): r for r in [*(a.req for a in self._active), *more]}
        self._active.clear()
        self.cache.release()
        for req in reqs.values():
            try:
                req.loop.call_soon_threadsafe(req.queue.put_nowait, error)
            except RuntimeError:  # its event loop is closed
                pass

    def _drop_aborted(self) -> None:
        with self._wake:
            self._waiting = deque(r for r in self._waiting if not r.aborted)
        dead = [i for i, a in enumerate(self._active) if a.req.aborted]
        self._remove_rows(dead)

    def _admit(self) -> list[_Request]:
        """Pop waiting requests (FIFO) that fit the batch, the KV budget and the prefill budget."""
        admitted: list[_Request] = []
        slots = len(self._active)
        # buffers only grow while anything is active, so what is allocated already counts
        reserve = max([a.req.reserve for a in self._active] + [self.cache.capacity])
        tokens, seen = 0, set()
        with self._wake:
            while self._waiting:
                req = self._waiting[0]
                new_slots, new_reserve = slots + req.params.n, max(reserve, req.reserve)
                kv = self._kv_bytes(max(new_slots, self.cache.slots), new_reserve)
                if new_slots > self.max_batch_size or kv > self.kv_budget:
                    break
                key = req.key
                new_tokens = 0 if key in seen else len(req.prompt_ids)  # repeated prompts prefill once
                if admitted and tokens + new_tokens > self.max_prefill_tokens:
                    break
                self._waiting.popleft()
                admitted.append(req)
                seen.add(key)
                slots, reserve, tokens = new_slots, new_reserve, tokens + new_tokens
            queued = sum(r.params.n for r in self._waiting)
        if admitted and (slots > self.cache.slots or reserve > self.cache.capacity):
            self._grow_cache(slots, reserve, queued)
        return admitted

    def _grow_cache(self, slots: int, reserve: int, queued: int) -> None:
        """Grow the KV buffers to `slots` rows of `reserve` positions: when the budget allows, with rows
        for the `queued` sequences still waiting too, and by half again, so rows trickling in rarely
        reallocate (each growth zeroes and copies every buffer)."""
        ahead = min(self.max_batch_size, max(slots + queued, self.cache.slots * 3 // 2, 8))
        for grown in (ahead, min(self.max_batch_size, max(slots, self.cache.slots * 3 // 2, 8))):
            if self._kv_bytes(grown, reserve) <= self.kv_budget:
                break
        else:
            grown = max(slots, self.cache.slots)
        self.cache.ensure(grown, reserve)

    def _prefill(self, reqs: list[_Request]) -> None:
        """Prefill new prompts (left-padded batches of similar length, long ones in chunks), then
        sample each request's first tokens. A prompt that starts with a cached prefix copies it and
        prefills only the rest, in the same batches. A request with n > 1, and any request whose
        prompt another new request has too, copies the prefilled KV row instead of computing it again."""
        first_row = len(self._active)
        rows, row = [], first_row
        for req in reqs:
            rows.append(row)
            row += req.params.n
        # identical prompts (e.g. the samples of one RL group sent as separate requests) prefill once
        first_of: dict[tuple, int] = {}
        for j, req in enumerate(reqs):
            first_of.setdefault(req.key, j)
        last_logits: dict[int, torch.Tensor] = {}
        scored: dict[int, PromptLogprobs] = {}
        pending: list[tuple[int, int]] = []  # (request, prompt tokens its row already holds)
        for j in sorted(set(first_of.values())):
            start = 0 if reqs[j].scoring else self._load_prefix(reqs[j], rows[j])
            if len(reqs[j].prompt_ids) - start > self._prefill_cap(reqs[j]):
                last_logits[j] = self._prefill_chunked(reqs[j], rows[j], start, scored, j)
            else:
                pending.append((j, start))
        pending = self._share_prefixes(reqs, rows, pending)
        pending.sort(key=lambda js: len(reqs[js[0]].prompt_ids) - js[1])
        for scoring in (False, True):  # scoring rows keep every position's logits: batches of their own
            batch: list[tuple[int, int]] = []
            for j, start in (js for js in pending if reqs[js[0]].scoring == scoring):
                width = len(reqs[j].prompt_ids) - start  # the longest so far: batches are padded to it
                if batch and (len(batch) + 1) * width > self._prefill_cap(reqs[j]):
                    last_logits.update(self._prefill_batch(reqs, rows, batch, scored))
                    batch = []
                batch.append((j, start))
            if batch:
                last_logits.update(self._prefill_batch(reqs, rows, batch, scored))
        new, expanded = [], []
        for j, req in enumerate(reqs):
            src = first_of[req.key]
            last_logits[j] = last_logits[src]
            for i in range(req.params.n):
                if (src, i) != (j, 0):
                    self.cache.copy_row(rows[src], rows[j] + i, len(req.prompt_ids))
                seq = Sequence(i, req.prompt_ids, req.params, self._decoder, self.eos_ids)
                seq.prompt_logprobs = scored.get(src)
                seed = None if req.params.seed is None else req.params.seed + i * _SEED_STRIDE
                req.seqs.append(seq)
                new.append(_Active(seq, req, RowSampler(req.params, seed, self.device), self._weights_version))
                expanded.append(last_logits[j])
        self._active.extend(new)
        self._sample_and_emit(torch.stack(expanded), first_row)

    def _prefill_cap(self, req: _Request) -> int:
        """Prompt tokens one forward takes for `req` (a scoring forward keeps all its logits: fewer)."""
        return self.score_tokens if req.scoring else self.forward_tokens

    def _load_prefix(self, req: _Request, row: int) -> int:
        """Copy the longest cached prefix of req's prompt into `row`; how many tokens that was (or 0)."""
        hit = self.prefix.lookup(req.adapter, req.prompt_ids)
        if hit is None:
            return 0
        entry, start = hit
        self.prefix.load(entry, start, self.cache, row)
        return start

    def _prefill_batch(
        self, reqs: list[_Request], rows: list[int], batch: list[tuple[int, int]], scored: dict[int, PromptLogprobs]
    ) -> dict:
        """One forward over the uncached rest of each (request j, start) in `batch`, left-padded to the
        longest; {j: its last-position logits [V]}. A batch of scoring requests (start 0) also puts each
        one's prompt logprobs in `scored[j]`."""
        dev = self.device
        rests = [reqs[j].prompt_ids[start:] for j, start in batch]
        starts = [start for _, start in batch]
        width = max(len(r) for r in rests)
        pads = [width - len(r) for r in rests]
        pad_t = torch.tensor(pads, device=dev)
        self.cache.set_prefill(torch.tensor([rows[j] for j, _ in batch], device=dev), pad_t, width, starts)
        adapters = [reqs[j].adapter for j, _ in batch for _ in range(width)]
        positions = (torch.arange(width, device=dev)[None, :] - pad_t[:, None]).clamp(min=0)
        scoring = reqs[batch[0][0]].scoring
        logits = self._forward(
            torch.tensor([[0] * p + r for p, r in zip(pads, rests)], device=dev),
            positions + torch.tensor(starts, device=dev)[:, None],
            self.masks.prefill(pad_t, width, starts),
            adapters,
            keep_all=scoring,
        )
        if not scoring:
            return {j: row_logits for (j, _), row_logits in zip(batch, logits[:, -1])}
        for b, ((j, _), pad, rest) in enumerate(zip(batch, pads, rests)):
            scored[j] = score(logits[b, pad : width - 1], rest[1:], reqs[j].params.prompt_logprobs)
        return {j: row_logits.clone() for (j, _), row_logits in zip(batch, logits[:, -1])}  # free the rest

    def _prefill_chunked(
        self, req: _Request, row: int, cached: int, scored: dict[int, PromptLogprobs], j: int = -1
    ) -> torch.Tensor:
        """The prompt from position `cached` on (0, or a reused prefix's length), chunk by chunk over
        what row `row` already holds; its last-position logits [V]. A scoring request (cached 0) also
        gets its prompt logprobs in `scored[j]`, chunk by chunk."""
        chunk, prompt, k = self._prefill_cap(req), req.prompt_ids, req.params.prompt_logprobs
        total = PromptLogprobs([], [], [] if k else None)
        for start in range(cached, len(prompt), chunk):
            piece = prompt[start : start + chunk]
            logits = self._extend(piece, req.adapter, row, start, keep_all=req.scoring)
            if req.scoring:  # row t predicts prompt[start + t + 1]; the prompt's last position predicts none
                targets = prompt[start + 1 : start + len(piece) + 1]
                total.extend(score(logits[0, : len(targets)], targets, k))
        if req.scoring:
            scored[j] = total
            return logits[0, -1].clone()
        return logits[0, -1]

    def _extend(self, piece: list[int], adapter: str | None, row: int, start: int, keep_all: bool) -> torch.Tensor:
        """One forward of `piece` at positions start.. of cache row `row`, over what the row holds before
        them; its logits [1, P or 1, V] (every position's only with `keep_all`)."""
        dev = self.device
        self.cache.set_extend(row, start, len(piece))
        ids, positions = torch.tensor([piece], device=dev), torch.arange(start, start + len(piece), device=dev)[None]
        mask = self.masks.extend(start, len(piece), dev)
        return self._forward(ids, positions, mask, [adapter] * len(piece), keep_all)

    def _share_prefixes(self, reqs: list[_Request], rows: list[int], pending: list[tuple[int, int]]) -> list:
        """New prompts with nothing cached that start with the same tokens (a chat template's header, a
        system prompt): prefill each shared prefix once, into the first one's row, copy it into the
        others' rows, and return `pending` with their starts raised past it (their rest prefills as
        prompts over a cached prefix do). Scoring prompts keep start 0 (they need every position's logits)."""
        fresh = [j for j, start in pending if start == 0 and not reqs[j].scoring]
        keys = [(reqs[j].adapter is not None, reqs[j].adapter or "", reqs[j].prompt_ids) for j in fresh]
        starts = dict(pending)
        for members, length in shared_prefix_groups(keys, SHARE_MIN_TOKENS, SHARE_MIN_SAVED):
            first, *others = [fresh[m] for m in members]
            prompt = reqs[first].prompt_ids
            for start in range(0, length, self.forward_tokens):
                piece = prompt[start : min(start + self.forward_tokens, length)]
                self._extend(piece, reqs[first].adapter, rows[first], start, keep_all=False)
            self.cache.move_rows([rows[first]] * len(others), [rows[j] for j in others], length)
            starts.update({j: length for j in [first, *others]})
        return [(j, starts[j]) for j, _ in pending]

    def _decode(self) -> None:
        dev = self.device
        lengths = [a.seq.length for a in self._active]
        positions = torch.tensor(lengths, device=dev) - 1  # the newest token is not cached yet
        kv_len = max(lengths)
        self.cache.set_decode(len(lengths), positions, kv_len)
        tokens = torch.tensor([[a.seq.output_ids[-1]] for a in self._active], device=dev)
        mask = self.masks.decode(positions, kv_len)
        logits = self._forward(tokens, positions[:, None], mask, [a.req.adapter for a in self._active], keep_all=False)
        self._sample_and_emit(logits[:, -1], 0)

    def _forward(
        self, ids: torch.Tensor, positions: torch.Tensor, mask, adapters: list[str | None], keep_all: bool
    ) -> torch.Tensor:
        """Logits of `ids` [b, P] at `positions` over the cache in the mode set (every position's with `keep_all`,
        else at least the last's); `adapters`: each token's LoRA adapter. The engine's own forward where it
        computes what HF's does (dense_forward.py), else HF's."""
        if self.dense is not None and self.cache.route_shape is None and not any(adapters):
            return self.dense.forward(ids, positions, mask, self.cache, last_only=not keep_all)
        self.lora.set_rows(adapters, self.device)
        kwargs = {"logits_to_keep": 1} if self._logits_to_keep and not keep_all else {}
        out = self.model(
            input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=self.cache, use_cache=True,
            **kwargs,
        )  # fmt: skip
        return out.logits

    def _sample_and_emit(self, logits: torch.Tensor, first_row: int) -> None:
        """Sample for active rows first_row.. (one logits row each), record, deliver, retire finished."""
        group = self._active[first_row:]
        banned = [a.seq.banned_ids() for a in group]
        result = sample(logits, [a.sampler for a in group], banned if any(banned) else None)
        finished = []
        for k, a in enumerate(group):
            top = result.top[k] if result.top is not None else None
            if a.seq.append(result.tokens[k], result.logprobs[k], top, self.max_model_len):
                finished.append(first_row + k)
                a.seq.routed_experts = self.cache.routes_of(first_row + k, a.seq.length - 1)
                if a.weights_version == self._weights_version and not a.req.scoring:
                    tokens = (a.req.prompt_ids + a.seq.output_ids)[:-1]  # its last token was never fed back
                    self.prefix.store(a.req.adapter, tokens, self.cache, first_row + k)
        self._deliver(group)
        self._remove_rows(finished)

    def _deliver(self, group: list[_Active]) -> None:
        """Hand new output to its requesters, one callback per event loop; a non-streaming request
        gets each sequence's output once, at its finish."""
        per_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Request, SeqDelta]]] = {}
        for a in group:
            if not a.req.stream and a.seq.finish_reason is None:
                continue
            delta = a.seq.take_delta()
            if delta is not None:
                per_loop.setdefault(a.req.loop, []).append((a.req, delta))
        for loop, items in per_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the requester's event loop is closed: nobody is listening
                for req, _ in items:
                    req.aborted = True

    def _remove_rows(self, rows: list[int]) -> None:
        """Retire rows, moving the last active rows into the holes so rows stay 0..B-1 (one KV copy for all)."""
        origin = list(range(len(self._active)))  # origin[r]: the row whose sequence row r holds after the moves
        for row in sorted(rows, reverse=True):
            origin[row] = origin[-1]
            origin.pop()
        moves = [(src, dst) for dst, src in enumerate(origin) if src != dst]
        if moves:
            length = max(self._active[src].seq.length for src, _ in moves)
            self.cache.move_rows([src for src, _ in moves], [dst for _, dst in moves], length)
        self._active = [self._active[src] for src in origin]
        if not self._active:
            self.cache.release()


class _RequestStream:
    """Async iterator over one request's deltas; `aclose()` (or garbage collection) before the end aborts it."""

    def __init__(self, engine: EmbeddedEngine, req: _Request):
        self._engine = engine
        self._req = req
        self._remaining = req.params.n

    def __aiter__(self) -> _RequestStream:
        return self

    async def __anext__(self) -> SeqDelta:
        if self._remaining == 0:
            raise StopAsyncIteration
        item = await self._req.queue.get()
        if isinstance(item, BaseException):
            self._remaining = 0
            raise item
        if item.finish_reason is not None:
            self._remaining -= 1
        return item

    async def aclose(self) -> None:
        if self._remaining:
            self._remaining = 0
            self._engine._abort(self._req)

    def __del__(self) -> None:
        if self._remaining:
            self._req.aborted = True


def _put_all(items: list[tuple[_Request, SeqDelta]]) -> None:
    for req, delta in items:
        req.queue.put_nowait(delta)


def forward_token_cap(device: torch.device, max_prefill_tokens: int) -> int:
    """Prompt tokens one prefill forward takes: `max_prefill_tokens` (what one step admits), on CPU at most
    CPU_FORWARD_TOKENS: there a step's prefill runs as forwards of about 1k tokens, whose activations
    stay in cache (256 distinct 67-token prompts, tiny model: 0.65 s against 0.80 s in 4k-token forwards)."""
    if device.type == "cpu":
        return min(max_prefill_tokens, CPU_FORWARD_TOKENS)
    return max_prefill_tokens


def kv_budget_on_gpu(free: int, total: int, utilization: float | None) -> int:
    """KV bytes on a GPU, the weights already loaded: half of what is free, or, with `gpu_memory_utilization`
    (PRIME-RL's way to share a GPU with the trainer), what keeps all use of the GPU under that fraction."""
    if utilization is None:
        return int(free * 0.5)
    budget = int(utilization * total) - (total - free)
    if budget <= 0:
        raise UserError(
            f"gpu_memory_utilization {utilization} leaves no room for the KV cache: {(total - free) / 2**30:.1f} of "
            f"{total / 2**30:.1f} GiB are in use already (weights included); raise it or set kv_cache_gb"
        )
    return budget
