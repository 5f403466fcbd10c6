"""The config files PRIME-RL's docs name exist at their paths and resolve; their lines parse as written.

Every file under `configs/` resolves (what `--dry-run` prints) as the entrypoint its directory names.
PRIME-RL's command lines that use them are copied verbatim from `../shared/seeds/` (the `uv run`
prefix dropped) and must resolve too. A hub model that cannot be reached says what it needs and where
the CPU twins are. (The CPU twins run for real in tests/integration/test_prime_rl_twins.py.)
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from asyncrl.config import cli, loader
from asyncrl.config.eval import EvalConfig
from asyncrl.config.inference import InferenceConfig
from asyncrl.config.orchestrator import OrchestratorConfig
from asyncrl.config.rl import RLConfig, resolve_rl
from asyncrl.config.sft import SFTConfig
from asyncrl.config.synthesize import SynthesizeConfig
from asyncrl.config.trainer import TrainerConfig
from asyncrl.core.errors import UserError

REPO = Path(__file__).resolve().parents[3]
CONFIGS = sorted((REPO / "configs").rglob("*.toml"))
KINDS = {"trainer": TrainerConfig, "orchestrator": OrchestratorConfig, "inference": InferenceConfig, "eval": EvalConfig}

# PRIME-RL's commands that name shipped configs (readme.md, rl-architecture.md, prime-rl-docs.md)
PRIME_RL_COMMANDS = [
    "trainer @ configs/trainer/debug.toml",
    "inference @ configs/inference/debug.toml",
    "orchestrator @ configs/orchestrator/debug.toml",
    "rl --trainer @ configs/trainer/reverse_text.toml --orchestrator @ configs/orchestrator/reverse_text.toml "
    "--inference @ configs/inference/reverse_text.toml",
    "rl --trainer @ configs/trainer/hendrycks_math/1b.toml "
    "--orchestrator @ configs/orchestrator/hendrycks_math/1b.toml "
    "--inference @ configs/inference/hendrycks_math/1b.toml --trainer-gpus 2 --inference-gpus 6",
    "rl --trainer @ configs/trainer/intellect_math/1b.toml "
    "--orchestrator @ configs/orchestrator/intellect_math/1b.toml "
    "--inference @ configs/inference/intellect_math/1b.toml --trainer-gpus 2 --inference-gpus 6",
    "rl --trainer @ configs/trainer/reverse_text.toml --orchestrator @ configs/orchestrator/reverse_text.toml "
    "--inference @ configs/inference/reverse_text.toml --exp-id exp-1",
    "rl --trainer @ configs/trainer/reverse_text.toml --orchestrator @ configs/orchestrator/reverse_text.toml "
    "--inference @ configs/inference/reverse_text.toml --inference.server.port 8001 --orchestrator.client.port 8001 "
    "--exp-id exp-2",
    "inference @ configs/inference/reverse_text.toml",
    "rl --trainer @ configs/trainer/reverse_text.toml --orchestrator @ configs/orchestrator/reverse_text.toml",
    "trainer @ configs/trainer/reverse_text.toml --ckpt.interval 10",
    "trainer @ configs/trainer/reverse_text.toml --ckpt.resume_step 10",
    "orchestrator @ configs/orchestrator/reverse_text.toml --bench",
    "trainer @ configs/trainer/reverse_text.toml --bench --data.fake "
    "\"{'micro_batch_size': 8, 'batch_size': 128, 'seq_len': 128}\"",
    "rl --trainer @ examples/reverse_text/rl/train.toml --orchestrator @ examples/reverse_text/rl/orch.toml "
    "--inference @ examples/reverse_text/rl/infer.toml",
    "inference @ examples/reverse_text/rl/infer.toml",
    "rl --trainer @ examples/reverse_text/rl/train.toml --orchestrator @ examples/reverse_text/rl/orch.toml",
    "orchestrator @ examples/reverse_text/rl/orch.toml",
    "trainer @ examples/reverse_text/rl/train.toml",
    "inference @ examples/reverse_text/rl/infer.toml --api-key $INFERENCE_SERVER_API_KEY",
    "eval @ configs/debug/eval/single_env.toml",
    "eval @ configs/debug/eval/multi_env.toml",
    "eval @ configs/debug/eval/local_model.toml --client.base-url http://localhost:8000/v1",
]
ENTRYPOINTS = {**KINDS, "rl": RLConfig, "sft": SFTConfig, "synthesize": SynthesizeConfig}


def resolve(entrypoint: str, argv: list[str]):
    model = ENTRYPOINTS[entrypoint]
    raw, args = loader.collect_raw(model, argv, {})
    return resolve_rl(raw, args) if model is RLConfig else loader.validate(model, raw)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(REPO / "configs")))
def test_every_shipped_config_resolves_as_its_entrypoint(path):
    kind = next(k for k in KINDS if k in path.relative_to(REPO / "configs").parts)
    assert path.read_text().startswith("#"), f"{path}: say in a comment what runs it and what it needs"
    resolve(kind, ["@", str(path)])


@pytest.mark.parametrize("command", PRIME_RL_COMMANDS)
def test_prime_rl_commands_resolve_as_written(command, monkeypatch):
    monkeypatch.chdir(REPO)
    entrypoint, *argv = shlex.split(command.replace("$INFERENCE_SERVER_API_KEY", "secret"))
    resolve(entrypoint, argv)


def test_prime_rl_paths_all_exist():
    named = {tok for c in PRIME_RL_COMMANDS for tok in shlex.split(c) if tok.endswith(".toml")}
    assert all((REPO / p).is_file() for p in named)
    assert len(named) == 18  # debug x3, reverse_text x3, the two math runs x3, eval x3, examples/reverse_text/rl x3


def test_gpu_counts_are_the_older_spelling_of_gpu_ids():
    cfg = resolve("rl", ["--trainer-gpus", "2", "--inference-gpus", "6"])
    assert cfg.inference_gpu_ids == [0, 1, 2, 3, 4, 5] and cfg.trainer_gpu_ids == [6, 7]
    with pytest.raises(UserError, match="by count .* or by id"):
        resolve("rl", ["--trainer-gpus", "2", "--trainer-gpu-ids", "[1]"])
    for flag, bad in [("--inference-gpus", "not-a-number"), ("--trainer-gpus", "0"), ("--trainer-gpus", "1.5")]:
        with pytest.raises(UserError, match=f"{flag} takes a number of GPUs .*got '{bad}'"):
            resolve("rl", [flag, bad])


def test_vllm_serves_on_every_inference_gpu(monkeypatch):
    monkeypatch.chdir(REPO)
    files = [f"--{c} @ configs/{c}/hendrycks_math/1b.toml" for c in ("trainer", "orchestrator", "inference")]
    cfg = resolve("rl", shlex.split(" ".join(files)) + ["--trainer-gpus", "2", "--inference-gpus", "6"])
    assert cfg.inference.backend == "vllm" and cfg.inference.data_parallel_size == 6
    tp2 = ["--inference.tensor-parallel-size", "2"]
    assert (
        resolve("rl", shlex.split(" ".join(files)) + ["--inference-gpus", "6", *tp2]).inference.data_parallel_size == 3
    )
    set_dp = ["--inference.data-parallel-size", "2"]
    assert (
        resolve("rl", shlex.split(" ".join(files)) + ["--inference-gpus", "6", *set_dp]).inference.data_parallel_size
        == 2
    )
    with pytest.raises(UserError, match="6 inference GPUs do not split into tensor-parallel groups of 4"):
        resolve("rl", shlex.split(" ".join(files)) + ["--inference-gpus", "6", "--inference.tensor-parallel-size", "4"])


def test_an_unreachable_hub_model_names_the_cpu_twins(monkeypatch):
    from asyncrl.trainer.model import _load_hf

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # for any process it starts; this one read the flag at import:
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)  # else ~30 s of retries to the hub
    with pytest.raises(UserError, match=r"hub id: it needs network access .* configs/debug/cpu/"):
        _load_hf("nobody-has/this-model-0", "sdpa", False)
    with pytest.raises(UserError, match=r"does not exist .* asyncrl-tiny-model DIR builds"):
        _load_hf("./no/such/dir", "sdpa", False)


def test_prime_rl_lines_with_older_or_shorthand_flags():
    cfg = resolve(
        "sft", shlex.split("sft --data.seq-len 4096 --data.batch-size 64 --data.micro-batch-size 2 --bench")[1:]
    )
    assert cfg.data.type == "fake" and cfg.data.seq_len == 4096  # --bench alone means fake data
    cfg = resolve("eval", ["--model.name", "Qwen/Qwen3-0.6B", "--benchmarks", "math500,aime24,aime25"])
    assert cfg.environment_ids == ["math500", "aime2024", "aime2025"]  # the hub ids of the older names
    assert resolve("eval", ["--env.id", "reverse-text"]).environment_ids == ["reverse-text"]
    argv = "--monitor.wandb.project p --ckpt.resume-step 10 --monitor.wandb.id t --orchestrator.monitor.wandb.id o"
    cfg = resolve("rl", ["--trainer", "@", "configs/trainer/reverse_text.toml", *argv.split()])
    assert (cfg.trainer.wandb.project, cfg.trainer.wandb.id, cfg.orchestrator.wandb.id) == ("p", "t", "o")
    assert resolve("trainer", ["--monitor.wandb.id", "t"]).wandb.id == "t"


@pytest.mark.parametrize(
    ("entrypoint", "flag", "says"),
    [
        ("trainer", "--model.cp", "context parallelism (one sequence split over several GPUs) is not implemented"),
    ],
)
def test_prime_rl_flags_that_cannot_work_here_say_why(entrypoint, flag, says, monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(UserError) as e:
        resolve(entrypoint, [flag, "x"])
    assert says in str(e.value) and "unknown option" not in str(e.value)


def test_auto_backend_is_vllm_with_cuda_and_vllm_only(monkeypatch):
    import importlib.util

    from asyncrl.config import inference
    from asyncrl.utils import cuda as cuda_check
    from asyncrl.utils import vllm_env

    choose = inference.auto_backend.__wrapped__  # uncached
    for has_vllm, cuda, engine, why in [
        (False, True, "embedded", "vLLM is not installed"),
        (True, False, "embedded", "no CUDA GPU"),
        (True, True, "vllm", "vLLM is installed and a CUDA GPU is visible"),
    ]:
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, has=has_vllm: object() if has else None)
        monkeypatch.setattr(vllm_env, "vllm_python", lambda: None)
        monkeypatch.setattr(cuda_check, "cuda_available", lambda cuda=cuda: cuda)
        assert choose()[0] == engine and why in choose()[1]


@pytest.fixture
def gpu_with_vllm(monkeypatch):
    """A machine where `backend = "auto"` picks vLLM."""
    from asyncrl.config import inference

    monkeypatch.setattr(inference, "auto_backend", lambda: ("vllm", "vLLM is installed and a CUDA GPU is visible"))


def test_rl_and_inference_use_vllm_by_default_where_it_can_run(gpu_with_vllm, monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = resolve("inference", ["--model.name", "Qwen/Qwen3-0.6B"])
    assert (cfg.backend, cfg.backend_why) == ("vllm", "auto: vLLM is installed and a CUDA GPU is visible")
    assert resolve("inference", ["--backend", "embedded"]).backend_why == "set in the config"
    cfg = resolve("rl", ["--inference.model.name", "m", "--inference-gpus", "4"])
    assert cfg.inference.backend == "vllm" and cfg.inference.data_parallel_size == 4
    # unknown flags go to vLLM when it is the engine, as with --backend vllm
    raw, args = loader.collect_raw(InferenceConfig, ["--enable-prefix-caching"], {}, passthrough=True)
    assert cli._pass_through(InferenceConfig, raw, args.passthrough)["vllm_args"] == ["--enable-prefix-caching"]


def test_without_cuda_the_embedded_engine_runs_and_says_why():
    cfg = resolve("inference", [])  # this machine: no CUDA GPU
    assert cfg.backend == "embedded" and ("no CUDA GPU" in cfg.backend_why or "not installed" in cfg.backend_why)


MULTI_NODE = {  # rl-architecture.md, "Multi-Node Inference", verbatim
    "head": "inference --data-parallel-size 4 --tensor-parallel-size 4 --data-parallel-size-local 2 "
    "--data-parallel-address $DATA_PARALLEL_ADDRESS --data-parallel-rpc-port 13345",
    "node": "inference --data-parallel-size 4 --tensor-parallel-size 4 --data-parallel-size-local 2 "
    "--data-parallel-address $DATA_PARALLEL_ADDRESS --data-parallel-rpc-port 13345 --data-parallel-start-rank 2 "
    "--headless",
}


def test_prime_rl_multi_node_inference_lines_become_vllm_flags(gpu_with_vllm):
    from asyncrl.inference.vllm.server import build_vllm_argv

    argv = build_vllm_argv(
        resolve("inference", shlex.split(MULTI_NODE["node"].replace("$DATA_PARALLEL_ADDRESS", "h"))[1:])
    )
    flags = " ".join(argv)
    assert "--data-parallel-size 4 --tensor-parallel-size 4" in flags
    assert "--data-parallel-size-local 2 --data-parallel-address h --data-parallel-rpc-port 13345" in flags
    assert argv[-3:] == ["--data-parallel-start-rank", "2", "--headless"]
    head = build_vllm_argv(
        resolve("inference", shlex.split(MULTI_NODE["head"].replace("$DATA_PARALLEL_ADDRESS", "h"))[1:])
    )
    assert "--headless" not in head and "--data-parallel-start-rank" not in head


@pytest.mark.parametrize("node", MULTI_NODE)
def test_prime_rl_multi_node_lines_without_vllm_say_what_they_need(node):
    says = r"multi-node data parallelism is vLLM's; serve with --backend vllm \(engine here: embedded, auto: "
    with pytest.raises(UserError, match=says):
        resolve("inference", shlex.split(MULTI_NODE[node].replace("$DATA_PARALLEL_ADDRESS", "10.0.0.1"))[1:])


def test_ckpt_path_is_the_checkpoint_directory_for_both_components(monkeypatch):
    """readme.md: `--ckpt.path to change the checkpoint directory (default: checkpoints)`."""
    monkeypatch.chdir(REPO)
    assert str(resolve("trainer", ["--ckpt"]).ckpt.path) == "checkpoints"
    cfg = resolve("rl", ["--trainer", "@", "configs/trainer/reverse_text.toml", "--ckpt.path", "/shared/ckpts"])
    assert str(cfg.trainer.ckpt.path) == str(cfg.orchestrator.ckpt.path) == "/shared/ckpts"


def test_another_components_option_is_noted_and_ignored(capsys):
    """readme.md gives `trainer` the orchestrator's run id too (`--orchestrator.monitor.wandb.id ID`)."""
    cfg = resolve(
        "trainer", ["--orchestrator.monitor.wandb.id", "o", "--orchestrator.batch-size", "8", "--max-steps", "3"]
    )
    assert cfg.max_steps == 3 and cfg.wandb is None  # both values consumed; nothing switched on
    assert (
        "--orchestrator.batch-size configures the orchestrator; this entrypoint ignores it" in capsys.readouterr().err
    )
