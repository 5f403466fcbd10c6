"""Load a HF causal LM + tokenizer and make it trainable: LoRA, tensor parallelism, activation checkpointing,
FSDP2 sharding.

Master weights are always float32; `optimization_dtype` only sets the compute dtype of FSDP2's mixed
precision policy and `reduce_dtype` the gradient reduce-scatter dtype. Every decoder layer is its own
FSDP2 unit; the root unit holds embeddings, final norm and lm_head (kept together so tied embeddings
stay one parameter). On a ("dp", "tp") mesh (`model.tp` > 1) the layers are first split over "tp"
(`trainer.tp`) and FSDP2 shards over "dp" only: 2-D DTensor parameters. With `model.ep` > 1 every MoE layer's
experts are split over an ("edp", "ep") mesh of the same ranks (`trainer.ep`) and are FSDP2 units over "edp".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from loguru import logger
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from asyncrl.config.trainer import TrainerModelConfig
from asyncrl.core.errors import UserError, model_hint
from asyncrl.trainer.ep import apply_ep, ep_mesh
from asyncrl.trainer.lora import SlotSelector, apply_lora, apply_multi_lora
from asyncrl.trainer.replay import RouterReplay, recorded_routes
from asyncrl.trainer.tp import apply_tp

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: object
    hf_config: object  # the model's PretrainedConfig
    export_dtype: torch.dtype  # dtype of the checkpoint we loaded; exports use it again
    matmul_params: int  # weights of all linear layers (incl. lm_head), for FLOP estimates
    lora_scale: float | None  # alpha / rank when LoRA is on
    stackable: bool  # packed rows stacked into [rows, length] keep their samples apart (see check_packing)
    selector: SlotSelector | None = None  # multi-run: which adapter slot the model applies
    slot_names: list[dict[str, str]] | None = None  # multi-run: per slot, {parameter name: PEFT key}


def _load_hf(name: str, attn: str, trust_remote_code: bool):
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoModelForCausalLM

    if name.startswith(("/", "./", "../", "~")) and not Path(name).expanduser().is_dir():
        raise UserError(
            f"model directory '{name}' does not exist (check --model.name; asyncrl-tiny-model DIR builds a tiny one)"
        )
    try:
        hf_config = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load model config '{name}': {str(e).splitlines()[0]} ({model_hint(name)})") from e
    export_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
    if isinstance(export_dtype, str):
        export_dtype = getattr(torch, export_dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            name, dtype=torch.float32, attn_implementation=attn, trust_remote_code=trust_remote_code
        )
    except SafetensorError as e:  # a truncated or corrupt weight file (e.g. a run's weights/step_N cut short)
        raise UserError(
            f"the weights of model '{name}' are truncated or corrupted ({str(e).splitlines()[0]}): copy them again, "
            "or, for a run's weights/step_N, use another step or the trainer checkpoint it was saved with"
        ) from None
    except (OSError, ValueError, ImportError) as e:
        raise UserError(
            f"cannot load model '{name}' with attn_implementation='{attn}': {str(e).splitlines()[0]}"
        ) from e
    return model, export_dtype


def load_tokenizer(name: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load tokenizer '{name}': {str(e).splitlines()[0]} (check --tokenizer.name)") from e


def count_matmul_params(model: nn.Module) -> int:
    """Weights of every nn.Linear (a tied lm_head counts: its matmul runs every token)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The ModuleList of transformer blocks (`model.model.layers` for most HF causal LMs)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    n = getattr(model.config, "num_hidden_layers", None)
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == n:
            return module
    raise UserError(f"cannot find the decoder layers of {type(model).__name__} (no ModuleList of {n} blocks)")


def _packing_error(model: nn.Module, rows: list[list[torch.Tensor]]) -> float:
    """Largest logit difference between samples packed in `rows` (stacked, shorter rows padded by a
    pseudo-sample) and each sample run alone. An MoE's samples run alone with the packed forward's routing (a
    near-tie between experts may go either way in a differently shaped forward: routing, not attention)."""
    length = max(sum(len(s) for s in row) for row in rows)
    spans = [row + [torch.zeros(length - sum(len(s) for s in row), dtype=torch.long)] for row in rows]
    ids = torch.stack([torch.cat(row) for row in spans])
    pos = torch.stack([torch.cat([torch.arange(len(s)) for s in row]) for row in spans])
    with recorded_routes(model) as chosen:
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    replay = RouterReplay(model) if chosen else None
    routes = torch.stack(chosen, 1).view(len(rows), length, len(chosen), -1).to(torch.uint8) if chosen else None
    err, starts = 0.0, [torch.tensor([0] + [len(s) for s in row]).cumsum(0).tolist() for row in rows]
    for r, row in enumerate(rows):
        for s, at in zip(row, starts[r]):
            if replay is not None:
                replay.set(routes[r, at : at + len(s)][None], torch.zeros(1, len(s), dtype=torch.bool))
            alone = model(input_ids=s[None], use_cache=False).logits[0]
            err = max(err, (logits[r, at : at + len(s)] - alone).abs().max().item())
    if replay is not None:
        replay.close()
    return err


@torch.no_grad()
def check_packing(model: nn.Module) -> bool:
    """Samples packed in one row (position_ids restart) must give the same logits as run alone;
    returns whether that also holds for rows stacked into a batch.

    HF models derive a block-diagonal causal mask from restarting position_ids (sdpa/eager/flex) or
    use varlen kernels (flash attention, which reads them from a single row only: stacked rows are
    not isolated there). A model or attention backend that ignores them would let packed samples
    attend to each other, so we refuse it up front.
    """
    vocab = model.get_input_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randint(0, vocab, (n,), generator=g) for n in (5, 4, 3))
    was_training = model.training
    model.eval()
    err = _packing_error(model, [[a, b]])
    stack_err = _packing_error(model, [[a, b], [c]])
    model.train(was_training)
    if err > 1e-3:
        raise UserError(
            f"model '{model.config.name_or_path}' with attn_implementation="
            f"'{model.config._attn_implementation}' lets packed samples attend to each other (max logit "
            f"diff {err:.2g}); use --model.attn-implementation sdpa, eager or flash_attention_2"
        )
    return stack_err <= 1e-3


def _apply_ac(layers: nn.ModuleList, freq: int) -> int:
    wrapped = 0
    for i in range(len(layers)):
        if i % freq == 0:
            layers[i] = checkpoint_wrapper(layers[i])  # keeps the RNG state: dropout recomputes identically
            wrapped += 1
    return wrapped


Experts = tuple[list[nn.Module], DeviceMesh]  # expert-parallel modules and their ("edp", "ep") mesh


def shard_model(model: nn.Module, mesh: DeviceMesh, cfg: TrainerModelConfig, experts: Experts | None = None) -> None:
    """FSDP2 over `mesh` (its "dp" dimension on a 2-D mesh): one unit per decoder layer, then the root; mixed
    precision and CPU offload from the config. Expert-parallel `experts` (modules, their ("edp", "ep") mesh) are
    units of their own first, over "edp", their gradients divided by all the ranks (`trainer.ep`)."""
    world = mesh.size()
    if mesh.ndim > 1:
        mesh = mesh["dp"]
    param_dtype, reduce_dtype = DTYPES[cfg.optimization_dtype], DTYPES[cfg.reduce_dtype]
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload: OffloadPolicy = OffloadPolicy()
    if cfg.fsdp_cpu_offload:
        if mesh.device_type == "cpu":
            logger.warning("model.fsdp_cpu_offload has no effect when training on CPU; ignoring it")
        else:
            offload = CPUOffloadPolicy()
    for module in experts[0] if experts else []:
        fully_shard(module, mesh=experts[1]["edp"], mp_policy=mp, offload_policy=offload)
        module.set_gradient_divide_factor(float(world))
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        # the last layer's params are needed again right away by backward: don't reshard them
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=i < len(layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)


def load_model(
    cfg: TrainerModelConfig, tokenizer_name: str | None, mesh: DeviceMesh, slots: int | None = None
) -> LoadedModel:
    """Load, check packing, add LoRA (`slots` adapters per layer for multi-run training) / activation
    checkpointing, shard onto `mesh`."""
    logger.info(f"loading model {cfg.name}")  # a big one takes a while: say so before
    model, export_dtype = _load_hf(cfg.name, cfg.attn_implementation, cfg.trust_remote_code)
    tokenizer = load_tokenizer(tokenizer_name or cfg.name, cfg.trust_remote_code)
    stackable = check_packing(model)
    if not stackable:
        logger.info(f"attention {cfg.attn_implementation} isolates samples within one row only: rows are concatenated")
    matmul = count_matmul_params(model)
    lora_scale, selector, slot_names = None, None, None
    if slots is not None:
        lora = cfg.lora
        selector, slot_names = apply_multi_lora(model, lora.rank, lora.alpha, lora.dropout, lora.target_modules, slots)
        per_slot = sum(p.numel() for p in model.parameters() if p.requires_grad) // slots
        logger.info(f"{slots} LoRA adapter slots of rank {lora.rank}: {per_slot:,} trainable parameters each")
    elif cfg.lora is not None:
        n = apply_lora(model, cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.target_modules)
        lora_scale = cfg.lora.alpha / cfg.lora.rank
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        logger.info(f"LoRA rank {cfg.lora.rank} on {n} layers: {trainable:,} trainable parameters")
    if mesh.ndim > 1:
        apply_tp(model, decoder_layers(model), mesh["tp"])
        logger.info(f"tensor parallelism: decoder layers split over {mesh['tp'].size()} ranks")
    experts = None
    if cfg.ep > 1:
        emesh = ep_mesh(mesh.device_type, mesh.size(), cfg.ep)
        experts = (apply_ep(model, emesh), emesh)
        logger.info(f"expert parallelism: each rank holds 1/{cfg.ep} of every layer's experts")
    if cfg.ac is not None:
        n = _apply_ac(decoder_layers(model), cfg.ac.freq)
        logger.info(f"activation checkpointing on {n}/{len(decoder_layers(model))} decoder layers")
    shard_model(model, mesh, cfg, experts)
    model.train()
    total = sum(p.numel() for p in model.parameters())
    logger.info(
        f"loaded {cfg.name}: {total:,} parameters, compute {cfg.optimization_dtype}, reduce {cfg.reduce_dtype}, "
        f"attention {model.config._attn_implementation}, world {mesh.size()}"
    )
    return LoadedModel(
        model, tokenizer, model.config, export_dtype, matmul, lora_scale, stackable, selector, slot_names
    )
