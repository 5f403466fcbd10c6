"""Every command line and TOML block of the PRIME-RL docs (../shared/seeds/*.md), by hand, with what it does here.

One row per line as the docs print it (`uv run ` dropped, continuation lines joined):

- `asyncrl` rows are our entrypoints. Each must resolve as written (what `--dry-run` does); placeholders
  (`...`, `path/to/x.toml`, `config.toml`, `<model-name>`, `$VARS`) are filled with the `fill` the row
  gives, so a reader sees what was tried. `error` rows must fail with that one-line message instead.
- `script` rows are torchrun lines naming PRIME-RL's script paths, which ship (src/prime_rl/...).
- `elsewhere` rows are other tools (installers, `prime`, `vllm serve`, `wandb login`, pytest, tmux).
- `needs`: what running the line for real needs beyond this machine (2 cores, no GPU, no hub):
  "" runs here, "gpu", "network" (a hub model or Environments Hub environment), or "gpu+network".

TOML blocks are at the end; each must validate as the config it is shown for.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_prime_rl_configs import REPO, resolve

from asyncrl.core.errors import UserError


@dataclass(frozen=True)
class Row:
    where: str  # doc:line
    line: str  # as the doc prints it
    kind: str  # asyncrl | script | elsewhere
    needs: str = ""  # "" | gpu | network | gpu+network
    fill: str = ""  # asyncrl: the line with its placeholders filled (default: `line`)
    error: str = ""  # asyncrl: it must fail, with this in its one line


RT = "--trainer @ configs/trainer/reverse_text.toml --orchestrator @ configs/orchestrator/reverse_text.toml"
RT3 = f"{RT} --inference @ configs/inference/reverse_text.toml"
EX = "--trainer @ examples/reverse_text/rl/train.toml --orchestrator @ examples/reverse_text/rl/orch.toml"
EX3 = f"{EX} --inference @ examples/reverse_text/rl/infer.toml"
MATH = "--trainer @ configs/trainer/{0}/1b.toml --orchestrator @ configs/orchestrator/{0}/1b.toml --inference @ configs/inference/{0}/1b.toml --trainer-gpus 2 --inference-gpus 6"  # noqa: E501
RL_CPU = "rl @ examples/reverse_text/rl.toml"  # a placeholder's stand-in that runs here (the demo's RL stage)
SFT_CPU = "sft @ examples/reverse_text/sft.toml"
MULTI = "inference --data-parallel-size 4 --tensor-parallel-size 4 --data-parallel-size-local 2 --data-parallel-address $DATA_PARALLEL_ADDRESS --data-parallel-rpc-port 13345"  # noqa: E501
NO_VLLM = "multi-node data parallelism is vLLM's; serve with --backend vllm"
EVAL_M = "eval --model.name <model-name> --environment-ids math500,aime2025"
EVAL_F = "eval --model.name Qwen/Qwen3-0.6B --environment-ids math500,aime2025"

ROWS = [
    # ---- readme.md
    Row(
        "readme.md:24",
        "curl -sSL https://raw.githubusercontent.com/PrimeIntellect-ai/prime-rl/main/scripts/install.sh | bash",
        "elsewhere",
        "network",
    ),  # noqa: E501
    Row("readme.md:27", "git clone git@github.com:PrimeIntellect-ai/prime-rl.git", "elsewhere", "network"),
    Row("readme.md:30", "curl -LsSf https://astral.sh/uv/install.sh | sh", "elsewhere", "network"),
    Row("readme.md:33", "uv sync && uv sync --extra fa", "elsewhere", "gpu"),  # uv: uv.lock; fa needs CUDA
    Row("readme.md:36", "python -V", "elsewhere"),
    Row("readme.md:38", 'python -c "import flash_attn"', "elsewhere", "gpu"),
    Row("readme.md:40", "trainer @ configs/trainer/debug.toml", "asyncrl", "gpu+network"),
    Row("readme.md:42", "inference @ configs/inference/debug.toml", "asyncrl", "gpu+network"),
    Row("readme.md:43", "orchestrator @ configs/orchestrator/debug.toml", "asyncrl", "gpu+network"),
    Row("readme.md:45", f"rl {RT3}", "asyncrl", "gpu+network"),
    Row("readme.md:53", "wandb login", "elsewhere", "network"),
    Row("readme.md:56", "huggingface-cli login", "elsewhere", "network"),
    Row("readme.md:61", "bash scripts/tmux.sh", "elsewhere"),
    Row("readme.md:77", f"rl {RT3}", "asyncrl", "gpu+network"),
    Row("readme.md:90", f"rl {MATH.format('hendrycks_math')}", "asyncrl", "gpu+network"),
    Row("readme.md:102", f"rl {MATH.format('intellect_math')}", "asyncrl", "gpu+network"),
    Row("readme.md:120", "bash scripts/tmux.sh exp-1", "elsewhere"),
    Row("readme.md:122", f"rl {RT3} --exp-id exp-1", "asyncrl", "gpu+network"),
    Row("readme.md:130", "bash scripts/tmux.sh exp-2", "elsewhere"),
    Row(
        "readme.md:132",
        f"CUDA_VISIBLE_DEVICES=3,4 rl {RT3} --inference.server.port 8001 --orchestrator.client.port 8001 --exp-id exp-2",  # noqa: E501
        "asyncrl",
        "gpu+network",
        fill=f"rl {RT3} --inference.server.port 8001 --orchestrator.client.port 8001 --exp-id exp-2",
    ),
    Row("readme.md:144", "inference --model.name Qwen/Qwen3-0.6B --max-model-len 2048", "asyncrl", "network"),
    Row("readme.md:145", "eval --model.name Qwen/Qwen3-0.6B --benchmarks math500,aime24,aime25", "asyncrl", "network"),
    Row("readme.md:156", "pre-commit install", "elsewhere"),
    Row(
        "readme.md:182",
        "PRIME_MODEL__NAME=Qwen/Qwen3-4B inference @qwen8b.toml @qwen14b.toml --model.name Qwen/Qwen3-32B",
        "asyncrl",
        "gpu+network",
        fill="inference @{tmp}/qwen8b.toml @{tmp}/qwen14b.toml --model.name Qwen/Qwen3-32B",
    ),
    Row("readme.md:191", "bash scripts/tmux.sh", "elsewhere"),
    Row("readme.md:193", "inference @ configs/inference/reverse_text.toml", "asyncrl", "gpu+network"),
    Row("readme.md:195", f"rl {RT}", "asyncrl", "gpu+network"),
    Row("readme.md:201", "bash scripts/tmux.sh kill", "elsewhere"),
    Row(
        "readme.md:233",
        "CUDA_VISIBLE_DEVICES=1 trainer @ configs/trainer/reverse_text.toml --ckpt.interval 10",
        "asyncrl",
        "gpu+network",
        fill="trainer @ configs/trainer/reverse_text.toml --ckpt.interval 10",
    ),
    Row(
        "readme.md:237",
        "CUDA_VISIBLE_DEVICES=1 trainer @ configs/trainer/reverse_text.toml --ckpt.resume_step 10",
        "asyncrl",
        "gpu+network",
        fill="trainer @ configs/trainer/reverse_text.toml --ckpt.resume_step 10",
    ),
    Row(
        "readme.md:241",
        "CUDA_VISIBLE_DEVICES=1 trainer @ configs/trainer/reverse_text.toml --monitor.wandb.project <project> "
        "--ckpt.resume-step 10 --monitor.wandb.id <trainer-run-id> --orchestrator.monitor.wandb.id <orchestrator-run-id>",  # noqa: E501
        "asyncrl",
        "gpu+network",
        fill="trainer @ configs/trainer/reverse_text.toml --monitor.wandb.project p --ckpt.resume-step 10 "
        "--monitor.wandb.id t --orchestrator.monitor.wandb.id o",
    ),
    Row("readme.md:255", "inference @ configs/inference/reverse_text.toml", "asyncrl", "gpu+network"),
    Row("readme.md:259", "orchestrator @ configs/orchestrator/reverse_text.toml --bench", "asyncrl", "gpu+network"),
    Row(
        "readme.md:265",
        "trainer @ configs/trainer/reverse_text.toml --bench --data.fake "
        "\"{'micro_batch_size': 8, 'batch_size': 128, 'seq_len': 128}\"",
        "asyncrl",
        "gpu+network",
    ),
    Row("readme.md:271", f"rl {RT3}", "asyncrl", "gpu+network"),
    Row("readme.md:280", "pytest -v", "elsewhere"),
    Row("readme.md:284", "pytest tests/unit -v", "elsewhere"),
    Row("readme.md:288", "pytest tests/integration -v", "elsewhere"),
    Row("readme.md:292", 'pytest -v -m "not gpu"', "elsewhere"),
    Row("readme.md:296", 'pytest -v -m "not slow"', "elsewhere"),
    # ---- rl-architecture.md
    Row("rl-architecture.md:16", "bash scripts/tmux.sh", "elsewhere"),
    Row("rl-architecture.md:23", f"rl {EX3}", "asyncrl", "network"),
    Row("rl-architecture.md:33", "inference @ examples/reverse_text/rl/infer.toml", "asyncrl", "network"),
    Row("rl-architecture.md:40", f"rl {EX}", "asyncrl", "network"),
    Row("rl-architecture.md:49", "inference @ examples/reverse_text/rl/infer.toml", "asyncrl", "network"),
    Row("rl-architecture.md:54", "orchestrator @ examples/reverse_text/rl/orch.toml", "asyncrl", "network"),
    Row("rl-architecture.md:59", "trainer @ examples/reverse_text/rl/train.toml", "asyncrl", "network"),
    Row("rl-architecture.md:72", "export OUTPUT_DIR=...", "elsewhere"),
    Row("rl-architecture.md:73", "export INFERENCE_SERVER_IP=...", "elsewhere"),
    Row("rl-architecture.md:74", "export INFERENCE_SERVER_API_KEY=...", "elsewhere"),
    Row(
        "rl-architecture.md:80",
        "inference @ examples/reverse_text/rl/infer.toml --api-key $INFERENCE_SERVER_API_KEY",
        "asyncrl",
        "network",
    ),
    Row(
        "rl-architecture.md:86",
        f"rl {EX} --orchestrator.client.base-url http://$INFERENCE_SERVER_IP:8000/v1 "
        "--orchestrator.client.api-key-var INFERENCE_SERVER_API_KEY --output-dir $OUTPUT_DIR",
        "asyncrl",
        "network",
    ),
    Row("rl-architecture.md:105", "export RDZV_ENDPOINT=10.15.42.1:1234", "elsewhere"),
    Row(
        "rl-architecture.md:114",
        "torchrun --nnodes=2 --nproc_per_node 8 --node-rank 0 --rdzv_endpoint=$RDZV_ENDPOINT src/prime_rl/trainer/rl/train.py",  # noqa: E501
        "script",
        "gpu+network",
    ),
    Row(
        "rl-architecture.md:124",
        "torchrun --nnodes=2 --nproc_per_node 8 --node-rank 1 --rdzv_endpoint=$RDZV_ENDPOINT src/prime_rl/trainer/rl/train.py",  # noqa: E501
        "script",
        "gpu+network",
    ),
    Row("rl-architecture.md:139", "export GLOO_SOCKET_IFNAME=eth0", "elsewhere"),
    Row("rl-architecture.md:140", "export NCCL_SOCKET_IFNAME=eth0", "elsewhere"),
    Row("rl-architecture.md:148", "export DATA_PARALLEL_ADDRESS=10.15.42.1", "elsewhere"),
    Row("rl-architecture.md:157", MULTI, "asyncrl", "gpu+network", error=NO_VLLM),
    Row(
        "rl-architecture.md:167",
        f"{MULTI} --data-parallel-start-rank 2 --headless",
        "asyncrl",
        "gpu+network",
        error=NO_VLLM,
    ),
    # ---- rl-sft-evals.md
    Row("rl-sft-evals.md:22", "inference ...", "asyncrl", fill="inference @ configs/debug/cpu/inference/debug.toml"),
    Row(
        "rl-sft-evals.md:23",
        "orchestrator ...",
        "asyncrl",
        fill="orchestrator @ configs/debug/cpu/orchestrator/debug.toml",
    ),
    Row("rl-sft-evals.md:24", "trainer ...", "asyncrl", fill="trainer @ configs/debug/cpu/trainer/debug.toml"),
    Row(
        "rl-sft-evals.md:26",
        "rl --trainer @ path/to/train.toml --orchestrator @ path/to/orch.toml --inference @ path/to/infer.toml ...",
        "asyncrl",
        "network",
        fill=f"rl {EX3}",
    ),
    Row("rl-sft-evals.md:36", "sft ...", "asyncrl", fill=SFT_CPU),
    Row(
        "rl-sft-evals.md:38",
        "torchrun --nproc-per-node 8 src/prime_rl/trainer/sft/train.py ...",
        "script",
        "gpu",
    ),
    Row(
        "rl-sft-evals.md:50",
        "inference --model.name <model-name>",
        "asyncrl",
        "network",
        fill="inference --model.name Qwen/Qwen3-0.6B",
    ),  # noqa: E501
    Row("rl-sft-evals.md:51", EVAL_M, "asyncrl", "network", fill=EVAL_F),
    Row(
        "rl-sft-evals.md:58",
        "inference --model.name <model-name>",
        "asyncrl",
        "network",
        fill="inference --model.name Qwen/Qwen3-0.6B",
    ),  # noqa: E501
    Row(
        "rl-sft-evals.md:59",
        f"{EVAL_M} --weights-dir outputs/weights",
        "asyncrl",
        "network",
        fill=f"{EVAL_F} --weights-dir outputs/weights",
    ),  # noqa: E501
    Row(
        "rl-sft-evals.md:64",
        f"{EVAL_M} --weights-dir outputs/weights --steps 10,20,30,40,50 --no-eval-base",
        "asyncrl",
        "network",
        fill=f"{EVAL_F} --weights-dir outputs/weights --steps 10,20,30,40,50 --no-eval-base",
    ),
    Row("rl-sft-evals.md:74", "export OPENAI_API_KEY=...", "elsewhere"),
    Row(
        "rl-sft-evals.md:76",
        "eval --client.base-url https://api.openai.com/v1 --client.api-key-var OPENAI_API_KEY --model.name <model-name> "  # noqa: E501
        "--environment-ids math500,aime2025",
        "asyncrl",
        "network",
        fill="eval --client.base-url https://api.openai.com/v1 --client.api-key-var OPENAI_API_KEY --model.name gpt-4.1 "  # noqa: E501
        "--environment-ids math500,aime2025",
    ),
    # ---- prime-rl-docs.md
    Row(
        "prime-rl-docs.md:56",
        "rl --trainer @ path/to/train.toml --orchestrator @ path/to/orch.toml --inference @ path/to/infer.toml",
        "asyncrl",
        "network",
        fill=f"rl {EX3}",
    ),
    Row("prime-rl-docs.md:62", "sft ...", "asyncrl", fill=SFT_CPU),
    Row("prime-rl-docs.md:65", "torchrun --nproc-per-node 8 src/prime_rl/trainer/sft/train.py ...", "script", "gpu"),
    Row("prime-rl-docs.md:70", "eval @ configs/debug/eval/single_env.toml", "asyncrl", "network"),
    Row("prime-rl-docs.md:71", "eval @ configs/debug/eval/multi_env.toml", "asyncrl", "network"),
    Row(
        "prime-rl-docs.md:72",
        "eval @ configs/debug/eval/local_model.toml --client.base-url http://localhost:8000/v1",
        "asyncrl",
        "network",
    ),
    Row(
        "prime-rl-docs.md:77",
        "synthesize",
        "asyncrl",
        error="no environment to run: pass --environment-ids a,b or [[env]] tables",
    ),
    Row(
        "prime-rl-docs.md:95",
        "inference @ path/to/config.toml",
        "asyncrl",
        fill="inference @ configs/debug/cpu/inference/debug.toml",
    ),  # noqa: E501
    Row("prime-rl-docs.md:107", "export PRIME_MODEL__NAME=Qwen/Qwen3-4B", "elsewhere"),
    Row(
        "prime-rl-docs.md:114",
        "PRIME_MODEL__NAME=Qwen/Qwen3-4B ... @ qwen8b.toml @ qwen14b.toml --model.name Qwen/Qwen3-32B",
        "asyncrl",
        "gpu+network",
        fill="inference @ {tmp}/qwen8b.toml @ {tmp}/qwen14b.toml --model.name Qwen/Qwen3-32B",
    ),
    Row("prime-rl-docs.md:164", "sft ... --max-steps 20 --ckpt", "asyncrl", fill=f"{SFT_CPU} --max-steps 20 --ckpt"),
    Row(
        "prime-rl-docs.md:167",
        "sft ... --max-steps 40 --ckpt.resume-step 20",
        "asyncrl",
        fill=f"{SFT_CPU} --max-steps 40 --ckpt.resume-step 20",
    ),
    Row("prime-rl-docs.md:176", "inference ...", "asyncrl", fill="inference @ configs/debug/cpu/inference/debug.toml"),
    Row(
        "prime-rl-docs.md:179",
        "rl --trainer @ path/to/train.toml --orchestrator @ path/to/orch.toml --max-steps 10 --ckpt",
        "asyncrl",
        "network",
        fill=f"rl {EX} --max-steps 10 --ckpt",
    ),
    Row(
        "prime-rl-docs.md:186",
        "rl --trainer @ path/to/train.toml --orchestrator @ path/to/orch.toml --max-steps 20 --ckpt.resume-step 10",
        "asyncrl",
        "network",
        fill=f"rl {EX} --max-steps 20 --ckpt.resume-step 10",
    ),
    Row("prime-rl-docs.md:205", "prime env info <owner>/<name>", "elsewhere", "network"),
    Row("prime-rl-docs.md:210", "prime env install <owner>/<name>", "elsewhere", "network"),
    Row("prime-rl-docs.md:222", 'python -c "import <name>"', "elsewhere"),
    Row("prime-rl-docs.md:271", "torchrun --local-ranks-filter 0 --nproc-per-node 8 ...", "script", "gpu"),
    Row("prime-rl-docs.md:279", "torchrun --log-dir outputs/torchrun --redirects 3 --tee 3 ...", "script", "gpu"),
    Row("prime-rl-docs.md:292", "sft ... --wandb", "asyncrl", "network", fill=f"{SFT_CPU} --wandb"),
    Row(
        "prime-rl-docs.md:293",
        "sft ... --wandb.project my-project --wandb.name my-run",
        "asyncrl",
        "network",
        fill=f"{SFT_CPU} --wandb.project my-project --wandb.name my-run",
    ),
    Row("prime-rl-docs.md:299", "rl ... --wandb", "asyncrl", "network", fill=f"{RL_CPU} --wandb"),
    Row(
        "prime-rl-docs.md:306",
        "rl ... --no-trainer.wandb.log-extras.distributions --orchestrator.wandb.log-extras.interval 50",
        "asyncrl",
        fill=f"{RL_CPU} --no-trainer.wandb.log-extras.distributions --orchestrator.wandb.log-extras.interval 50",
    ),
    Row("prime-rl-docs.md:313", "wandb login", "elsewhere", "network"),
    Row("prime-rl-docs.md:315", "export WANDB_API_KEY=...", "elsewhere"),
    Row(
        "prime-rl-docs.md:328",
        "sft ... --data.type fake --bench",
        "asyncrl",
        fill=f"{SFT_CPU} --data.type fake --bench",
    ),
    Row(
        "prime-rl-docs.md:331",
        "sft ... --data.seq-len 4096 --data.batch-size 64 --data.micro-batch-size 2 --bench",
        "asyncrl",
        fill=f"{SFT_CPU} --data.seq-len 4096 --data.batch-size 64 --data.micro-batch-size 2 --bench",
    ),
    Row(
        "prime-rl-docs.md:344",
        "rl --trainer @ path/to/train.toml --orchestrator @ path/to/orch.toml --inference @ path/to/infer.toml --bench",
        "asyncrl",
        "network",
        fill=f"rl {EX3} --bench",
    ),
    Row("prime-rl-docs.md:355", "sft ...", "asyncrl", fill=SFT_CPU),
    Row("prime-rl-docs.md:360", "torchrun --nproc-per-node 8 --local-rank-filter 0 ...", "script", "gpu"),
    Row("prime-rl-docs.md:435", "... @ path/to/config.toml", "asyncrl", fill=RL_CPU),
    Row("prime-rl-docs.md:438", "... @path/to/config.toml", "asyncrl", fill="rl @examples/reverse_text/rl.toml"),
    Row("prime-rl-docs.md:479", "rl @ config.toml --wandb", "asyncrl", "network", fill=f"{RL_CPU} --wandb"),
    Row(
        "prime-rl-docs.md:484",
        "rl @ config.toml --ckpt --ckpt.interval 10 --ckpt.keep-last 3",
        "asyncrl",
        fill=f"{RL_CPU} --ckpt --ckpt.interval 10 --ckpt.keep-last 3",
    ),
    Row(
        "prime-rl-docs.md:489",
        "rl @ config.toml --ckpt.resume-step 50 --max-steps 100",
        "asyncrl",
        fill=f"{RL_CPU} --ckpt.resume-step 50 --max-steps 100",
    ),
    Row(
        "prime-rl-docs.md:494",
        "eval @ eval_config.toml",
        "asyncrl",
        fill="eval @ configs/debug/cpu/eval/single_env.toml",
    ),
    Row("prime-rl-docs.md:499", "prime env install <owner>/<name>", "elsewhere", "network"),
    Row("prime-rl-docs.md:528", "export VLLM_USE_V1=0", "elsewhere"),
    Row("prime-rl-docs.md:529", "export VLLM_WORKER_MULTIPROC_METHOD=spawn", "elsewhere"),
    Row(
        "prime-rl-docs.md:530",
        "rl @ config.toml --ckpt --ckpt.interval 5 --ckpt.keep-last 3",
        "asyncrl",
        "gpu+network",
        fill="rl @ examples/prime_rl_docs/single_gpu.toml --ckpt --ckpt.interval 5 --ckpt.keep-last 3",
    ),
    # ---- training-and-evaluation-guide.md
    Row(
        "training-and-evaluation-guide.md:88",
        "rl @ configs/prime-rl/my-config.toml",
        "asyncrl",
        "gpu+network",
        fill="rl @ examples/prime_rl_docs/full_guide.toml",
    ),
    Row(
        "training-and-evaluation-guide.md:207",
        "rl @ configs/prime-rl/my-config.toml --trainer.ckpt.resume-step 50",
        "asyncrl",
        "gpu+network",
        fill="rl @ examples/prime_rl_docs/full_guide.toml --trainer.ckpt.resume-step 50",
    ),
    Row(
        "training-and-evaluation-guide.md:220",
        "CUDA_VISIBLE_DEVICES=0,1,2 vllm serve Qwen/Qwen2.5-7B-Instruct --port 8007 --data-parallel-size 3 "
        "--gpu-memory-utilization 0.7 --max-model-len 16384 --enable-auto-tool-choice --tool-call-parser hermes "
        "--enforce-eager",
        "elsewhere",
        "gpu+network",
    ),
    Row(
        "training-and-evaluation-guide.md:233",
        "prime eval run vf-musique -m Qwen/Qwen2.5-7B-Instruct -b http://0.0.0.0:8007/v1",
        "elsewhere",
        "network",
    ),  # noqa: E501
    Row("training-and-evaluation-guide.md:236", "prime eval run vf-musique -m gpt-5-nano", "elsewhere", "network"),
    Row(
        "training-and-evaluation-guide.md:241",
        "vllm serve mit-oasys/rlm-qwen3-8b-v0.1 --port 8007 --enable-auto-tool-choice --tool-call-parser hermes "
        "--reasoning-parser qwen3 --enforce-eager",
        "elsewhere",
        "gpu+network",
    ),
    Row(
        "training-and-evaluation-guide.md:256",
        "eval --client.base-url http://localhost:8007/v1 --weights-dir outputs/weights --env.id my-env",
        "asyncrl",
        "gpu+network",
    ),
    Row(
        "training-and-evaluation-guide.md:264",
        "eval --weights-dir outputs/weights --steps 10,50,100 --no-eval-base",
        "asyncrl",
        "gpu+network",
        error="no environment to run: pass --environment-ids a,b or [[env]] tables",
    ),
    Row("training-and-evaluation-guide.md:288", "prime eval tui", "elsewhere"),
    Row("training-and-evaluation-guide.md:306", "prime env install my-env", "elsewhere", "network"),
]
ASYNCRL = [r for r in ROWS if r.kind == "asyncrl"]
ENV = {  # the `export`s the docs show before their lines
    "$INFERENCE_SERVER_API_KEY": "secret",
    "$INFERENCE_SERVER_IP": "10.15.42.2",
    "$OUTPUT_DIR": "/shared/run",
    "$DATA_PARALLEL_ADDRESS": "10.15.42.1",
}
QWEN = {"qwen8b.toml": "[model]\nname = 'Qwen/Qwen3-8B'\n", "qwen14b.toml": "[model]\nname = 'Qwen/Qwen-14B'\n"}


def argv_of(row: Row, tmp: Path) -> tuple[str, list[str]]:
    text = (row.fill or row.line).replace("{tmp}", str(tmp))
    for var, value in ENV.items():
        text = text.replace(var, value)
    entrypoint, *argv = shlex.split(text)
    return entrypoint, argv


@pytest.mark.parametrize("row", ASYNCRL, ids=lambda r: r.where)
def test_prime_rl_line_resolves_or_says_what_it_needs(row, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    for name, text in QWEN.items():
        (tmp_path / name).write_text(text)
    entrypoint, argv = argv_of(row, tmp_path)
    assert row.fill or "..." not in row.line
    if row.error:
        with pytest.raises(UserError, match=re.escape(row.error)):
            resolve(entrypoint, argv)
        return
    cfg = resolve(entrypoint, argv)
    if "qwen8b.toml" in row.line:
        assert cfg.model.name == "Qwen/Qwen3-32B"  # the docs' precedence example: the command line wins


def test_precedence_example_without_the_flag_takes_the_later_file(tmp_path):
    for name, text in QWEN.items():
        (tmp_path / name).write_text(text)
    from asyncrl.config import loader
    from asyncrl.config.inference import InferenceConfig

    env = {"PRIME_MODEL__NAME": "Qwen/Qwen3-4B"}
    files = ["@", str(tmp_path / "qwen8b.toml"), "@", str(tmp_path / "qwen14b.toml")]
    assert loader.load_config(InferenceConfig, files, env).model.name == "Qwen/Qwen-14B"
    assert loader.load_config(InferenceConfig, files[:2], env).model.name == "Qwen/Qwen3-8B"
    assert loader.load_config(InferenceConfig, [], env).model.name == "Qwen/Qwen3-4B"
    assert loader.load_config(InferenceConfig, [], {}).model.name == "Qwen/Qwen3-0.6B"


def test_what_the_elsewhere_lines_rely_on_is_here():
    assert (REPO / "scripts" / "tmux.sh").is_file()
    assert (REPO / "scripts" / "install.sh").is_file()  # the installer's name (readme.md:24)
    assert (REPO / "uv.lock").is_file()  # `uv sync` (readme.md:33); tests/unit/scripts/test_locks.py checks it
    assert "fa" in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    markers = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert {m.split(":")[0] for m in markers} >= {"gpu", "slow"}  # `pytest -m "not gpu"` / "not slow"


@pytest.mark.parametrize("row", [r for r in ROWS if r.kind == "script"], ids=lambda r: r.where)
def test_prime_rl_torchrun_script_paths_ship(row):
    script = next((t for t in row.line.split() if t.startswith("src/prime_rl/")), None)
    assert script is None or (REPO / script).is_file()  # a line without a path runs `torchrun` on a command


@pytest.mark.slow
def test_prime_rl_two_node_trainer_lines_train(tmp_path):
    """rl-architecture.md's multi-node trainer lines, as written but with 1 process per node (not 8), the CPU
    twin's config and 2 steps: two torchrun agents rendezvous and train as 2 ranks."""
    from asyncrl.utils.process import free_port
    from asyncrl.utils.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "model", num_layers=2)
    endpoint = f"127.0.0.1:{free_port()}"
    extra = ["@", "configs/debug/cpu/trainer/debug.toml", "--model.name", str(model), "--max-steps", "2"]
    procs = []
    for rank, where in enumerate(("rl-architecture.md:114", "rl-architecture.md:124")):
        line = next(r.line for r in ROWS if r.where == where)
        line = line.replace("$RDZV_ENDPOINT", endpoint).replace("--nproc_per_node 8", "--nproc_per_node 1")
        cmd = [sys.executable, "-m", "torch.distributed.run", *line.split()[1:], *extra]
        procs.append(subprocess.Popen([*cmd, "--output-dir", str(tmp_path / f"node{rank}")], cwd=REPO))
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    assert "world 2" in (tmp_path / "node0" / "logs" / "trainer.log").read_text()  # one rank on each node


# ---- TOML blocks: (doc:line, config it is shown for, the block verbatim)
TOML_BLOCKS = [
    ("prime-rl-docs.md:99", "inference", '[model]\nname = "Qwen/Qwen3-8B"\n'),
    ("readme.md:172", "inference", '[model]\nname = "Qwen/Qwen3-8B"\n'),
    ("readme.md:175", "inference", '[model]\nname = "Qwen/Qwen-14B"\n'),
    (
        "prime-rl-docs.md:508",
        "rl",
        "inference_gpu_ids = [0]\ntrainer_gpu_ids = [0]\n\n[inference]\ngpu_memory_utilization = 0.50  # Leave room "
        "for trainer!\n\n[trainer.model.ac]\nfreq = 1  # Activation checkpointing\n\n[orchestrator]\nbatch_size = 8\n"
        "rollouts_per_example = 2\n\n[orchestrator.sampling]\nmax_tokens = 2000  # Must fit within max_model_len - "
        "input_tokens\n",
    ),
]
GUIDE = REPO.parent / "shared" / "seeds" / "training-and-evaluation-guide.md"


def guide_blocks() -> list[tuple[str, str]]:
    """The guide's ```toml blocks (all `rl` configs), read from the doc so that none is left out."""
    lines, blocks, start = GUIDE.read_text().splitlines(), [], None
    for i, line in enumerate(lines, 1):
        if line.strip() == "```toml":
            start = i
        elif line.strip() == "```" and start is not None:
            blocks.append((f"training-and-evaluation-guide.md:{start}", "\n".join(lines[start : i - 1]) + "\n"))
            start = None
    return blocks


@pytest.mark.parametrize(("where", "kind", "block"), TOML_BLOCKS, ids=[b[0] for b in TOML_BLOCKS])
def test_prime_rl_toml_blocks_validate(where, kind, block, tmp_path):
    (tmp_path / "c.toml").write_text(block)
    resolve(kind, ["@", str(tmp_path / "c.toml")])


@pytest.mark.skipif(not GUIDE.is_file(), reason="the PRIME-RL docs are not beside this checkout")
def test_the_guides_toml_blocks_validate_as_rl_configs(tmp_path):
    blocks = guide_blocks()
    assert len(blocks) == 9
    for _, block in blocks:
        if "# Wrong" in block:  # the troubleshooting pair: the wrong half fails with one clear line
            wrong, right = block.split("# Right")
            (tmp_path / "w.toml").write_text(wrong)
            with pytest.raises(UserError, match="is a section; write it as a table"):
                resolve("rl", ["@", str(tmp_path / "w.toml")])
            block = right
        (tmp_path / "c.toml").write_text(block)
        resolve("rl", ["@", str(tmp_path / "c.toml")])


def test_the_table_counts():
    """The counts for the note; a change to the table is deliberate."""
    kinds = {k: sum(r.kind == k for r in ROWS) for k in ("asyncrl", "script", "elsewhere")}
    assert len({r.where for r in ROWS}) == len(ROWS) == 124
    assert kinds == {"asyncrl": 74, "script": 7, "elsewhere": 43}
    ours = [r for r in ROWS if r.kind != "elsewhere"]
    assert sum(r.needs == "" for r in ours) == 19  # run here (placeholders filled with CPU configs)
    assert sum(r.needs != "" for r in ours) == 62  # need a GPU and/or the network (hub model or environment)
    assert sum(r.error != "" for r in ROWS) == 4  # fail here, with one line saying what they need
    assert len(TOML_BLOCKS) == 4  # + the guide's 9 (test_the_guides_toml_blocks_validate_as_rl_configs)
