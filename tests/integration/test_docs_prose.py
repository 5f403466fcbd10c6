"""What the PRIME-RL docs' prose promises, run as the docs state it.

Each section is one item of issue 32 ("Seed parity, round 2"): a behaviour the PRIME-RL docs
(../shared/seeds/*.md) describe in prose, run with the docs' own lines, a tiny local model (the session's
`tiny_model_dir`) and the shipped CPU configs in place of hub models and GPUs. Kept cheap: command-line checks
are `--help` / `--dry-run` subprocesses (no model load); the runs are `rl` runs of 2-3 steps, marked slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from asyncrl.transport.layout import RunLayout, step_dirs
from asyncrl.transport.weights import weights_problem
from asyncrl.utils.process import free_port
from tests import warm

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "examples" / "prime_rl_docs" / "full_guide.toml"  # the guide's full config, verbatim


def entrypoint(name: str, *args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`uv run NAME ARGS` as the docs write it, run from the repository root (`env`: variables added)."""
    cmd = [sys.executable, "-m", f"asyncrl.entrypoints.{name}", *args]
    env = dict(os.environ, **(env or {}))
    return warm.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)


def dry_run(name: str, *args: str, env: dict | None = None) -> dict:
    """The config `NAME ARGS --dry-run` resolves to (what each process would run with)."""
    done = entrypoint(name, *args, "--dry-run", env=env)
    assert done.returncode == 0, done.stderr
    return tomllib.loads(done.stdout)


def tiny_rl_config(path: Path, model: Path, out: Path, max_steps: int, extra: str = "") -> Path:
    """A config file like the guide's, shrunk to the tiny model on CPU: 2-3 short steps of reverse-text."""
    path.write_text(
        f'max_steps = {max_steps}\nseq_len = 128\nmax_async_level = 1\noutput_dir = "{out}"\n\n'
        f'[model]\nname = "{model}"\n\n'
        "[orchestrator]\nbatch_size = 16\nrollouts_per_example = 4\n\n"
        "[orchestrator.sampling]\nmax_tokens = 8\n\n"
        '[[orchestrator.env]]\nid = "reverse-text"\n\n'
        f'[inference]\n\n[inference.server]\nhost = "127.0.0.1"\nport = {free_port()}\n' + extra
    )
    return path


def metric_steps(out: Path, process: str) -> list[int]:
    rows = [json.loads(line) for line in (out / "metrics" / f"{process}.jsonl").read_text().splitlines() if line]
    return [r["step"] for r in rows if r.get("kind", "train") == "train"]


def ran(done: subprocess.CompletedProcess) -> str:
    return done.stdout[-3000:] + done.stderr[-3000:]


# ---- item 1: the guide's checkpoint section, then its resume line ----------------------------------------------
# training-and-evaluation-guide.md, "Checkpointing & Resuming": `[trainer.ckpt]` (interval / keep_last /
# keep_interval), then `uv run rl @ configs/prime-rl/my-config.toml --trainer.ckpt.resume-step 50`. In rl the
# checkpoint section is the run's: the orchestrator checkpoints beside the trainer, so the resume finds both.


@pytest.mark.slow
def test_guide_trainer_ckpt_section_then_its_resume_line(tiny_model_dir, tmp_path):
    out = tmp_path / "outputs"
    guide_block = "\n[trainer.ckpt]\ninterval = 1        # save every N steps\nkeep_last = 3\nkeep_interval = 50\n"
    config = tiny_rl_config(tmp_path / "my-config.toml", tiny_model_dir, out, 2, guide_block)
    first = entrypoint("rl", "@", str(config))
    assert first.returncode == 0, ran(first)
    assert (out / "checkpoints" / "step_2" / "orchestrator").is_dir() and (out / "weights" / "step_2").is_dir()

    resumed = entrypoint("rl", "@", str(config), "--trainer.ckpt.resume-step", "2", "--max-steps", "3")
    assert resumed.returncode == 0, ran(resumed)
    assert metric_steps(out, "orchestrator") == metric_steps(out, "trainer") == [0, 1, 2]  # continued at step 2
    assert (out / "weights" / "step_3").is_dir()


# ---- item 3: keep_last / keep_interval prune weights/ as well as checkpoints/ ------------------------------------
# prime-rl-docs.md: `uv run rl @ config.toml --ckpt --ckpt.interval 10 --ckpt.keep-last 3` (+ `--ckpt.keep-interval
# N`: "preserve checkpoints at every N steps permanently"); the guide: "Checkpoints are saved to
# outputs/weights/step_{N}/ and outputs/checkpoints/step_{N}/". The readme: weight checkpoints a resume needs are
# kept, the rest cleaned up.


@pytest.mark.slow
def test_keep_last_prunes_weight_exports_too(tiny_model_dir, tmp_path):
    out = tmp_path / "outputs"
    config = tiny_rl_config(tmp_path / "config.toml", tiny_model_dir, out, 4)
    done = entrypoint(
        "rl", "@", str(config), "--ckpt", "--ckpt.interval", "1", "--ckpt.keep-last", "1", "--ckpt.keep-interval", "2"
    )
    assert done.returncode == 0, ran(done)
    assert RunLayout(out).resumable_steps() == [2, 4]  # the last one plus multiples of 2
    assert sorted(step_dirs(out / "weights")) == [2, 4]  # weights/step_1 and step_3 pruned with their checkpoints
    assert all(weights_problem(out / "weights" / f"step_{s}") is None for s in (2, 4))  # the kept ones whole


# ---- item 4: --help shows the defaults each entrypoint really runs with; --dry-run what each process runs --------
# rl-sft-evals.md: "To see all available configuration options, run uv run sft --help" (and `rl --help`).


def help_default(text: str, flag: str) -> str:
    line = next(x for x in text.splitlines() if x.strip().startswith(f"{flag} "))
    return line.rsplit("(default: ", 1)[1].removesuffix(")")


def test_sft_help_shows_the_defaults_sft_runs_with():
    text = entrypoint("sft", "--help").stdout
    ran_with = dry_run("sft")  # a bare `sft`
    assert float(help_default(text, "--optim.lr")) == ran_with["optim"]["lr"] == 2e-5
    assert help_default(text, "--data.type") == repr(ran_with["data"]["type"]) == "'fake'"
    assert float(help_default(entrypoint("trainer", "--help").stdout, "--optim.lr")) == 1e-6  # RL's own


def test_rl_dry_run_prints_what_each_component_runs_with(tiny_model_dir):
    cfg = dry_run("rl", "@", str(GUIDE), "--trainer.model.name", str(tiny_model_dir))
    names = {cfg["model"]["name"]} | {cfg[c]["model"]["name"] for c in ("trainer", "orchestrator", "inference")}
    assert names == {str(tiny_model_dir)}  # no stale top-level [model] from the file


# ---- item 5: RLOO / OPO ("Training objectives: GRPO, GSPO, OPO, RLOO, CISPO") --------------------------------------
# Here they are advantage estimators: the loss flag names the option where they live, in one line.


@pytest.mark.parametrize("line", [("trainer", "--loss.type", "rloo"), ("rl", "--trainer.loss.type", "opo")])
def test_rloo_and_opo_as_a_loss_name_the_advantage_option(line):
    done = entrypoint(*line, "--dry-run")
    assert done.returncode == 2 and not done.stdout
    (message,) = done.stderr.strip().splitlines()
    assert message.startswith("error: ") and f"--orchestrator.advantage.type {line[-1]}" in message
    assert dry_run("rl", "--orchestrator.advantage.type", line[-1])["orchestrator"]["advantage"]["type"] == line[-1]


# ---- item 6: `async_level` (readme: "Each run with asynchrony level async_level ...") --------------------------------
# Accepted wherever max_async_level is: flag, TOML key, rl's propagation; both given and different: one line.


def test_async_level_is_max_async_level(tmp_path):
    assert dry_run("orchestrator", "--async-level", "0")["max_async_level"] == 0
    assert dry_run("trainer", "--async-level", "1")["max_async_level"] == 1
    toml = tmp_path / "rl.toml"
    toml.write_text("async_level = 1\n")
    cfg = dry_run("rl", "@", str(toml))
    assert cfg["max_async_level"] == cfg["trainer"]["max_async_level"] == cfg["orchestrator"]["max_async_level"] == 1
    cfg = dry_run("rl", "--trainer.async-level", "0")
    assert cfg["trainer"]["max_async_level"] == cfg["orchestrator"]["max_async_level"] == 0
    for args in (["--async-level", "1", "--max-async-level", "2"], ["@", str(toml), "--max-async-level", "2"]):
        done = entrypoint("rl", *args, "--dry-run")
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "async_level" in done.stderr and "max_async_level" in done.stderr


# ---- 2. W&B in rl: "Both trainer and orchestrator log as separate W&B runs ... Trainer run appends `-trainer`,
# orchestrator appends `-orchestrator`" (prime-rl-docs.md), wherever the name comes from; one id would make them
# one W&B run, so a shared id is made distinct the same way.


def test_rl_wandb_name_and_id_on_the_command_line_make_two_runs():
    cfg = dry_run("rl", "--wandb", "--wandb.project", "my-project", "--wandb.name", "my-run", "--wandb.id", "my-id")
    runs = {c: (cfg[c]["wandb"]["name"], cfg[c]["wandb"]["id"]) for c in ("trainer", "orchestrator")}
    assert runs == {
        "trainer": ("my-run-trainer", "my-id-trainer"),
        "orchestrator": ("my-run-orchestrator", "my-id-orchestrator"),
    }
    assert cfg["trainer"]["wandb"]["project"] == cfg["orchestrator"]["wandb"]["project"] == "my-project"


def test_rl_wandb_name_from_a_toml_and_a_components_own_values(tmp_path):
    (tmp_path / "rl.toml").write_text('[wandb]\nproject = "my-project"\nname = "my-run"\n')
    cfg = dry_run("rl", "@", str(tmp_path / "rl.toml"), "--orchestrator.wandb.name", "mine")
    assert (cfg["trainer"]["wandb"]["name"], cfg["orchestrator"]["wandb"]["name"]) == ("my-run-trainer", "mine")
    # readme.md's resume line: each component's own run id, as given (no suffix on an id only one takes)
    cfg = dry_run("rl", "--wandb.id", "t-run", "--orchestrator.wandb.id", "o-run")
    assert (cfg["trainer"]["wandb"]["id"], cfg["orchestrator"]["wandb"]["id"]) == ("t-run", "o-run")


def test_multi_run_wandb_ids_are_one_per_run():
    from asyncrl.config.rl import resolve_rl

    raw = {"model": {"name": "m"}, "trainer": {"model": {"lora": {"rank": 8}}}, "wandb": {"name": "x", "id": "i"}}
    orchestrators = resolve_rl({**raw, "runs": [{"name": "a"}, {"name": "b"}]}).run_orchestrators()
    assert [(o.wandb.name, o.wandb.id) for o in orchestrators.values()] == [
        ("x-orchestrator-a", "i-orchestrator-a"),
        ("x-orchestrator-b", "i-orchestrator-b"),
    ]


# ---- 7. "vLLM multi-node data parallelism: Set `DATA_PARALLEL_ADDRESS` to head node IP, Set
# `DATA_PARALLEL_RPC_PORT`" (prime-rl-docs.md): `inference` reads them; a flag wins.


def test_inference_reads_data_parallel_address_and_port_from_the_environment():
    env = {"DATA_PARALLEL_ADDRESS": "10.15.42.1", "DATA_PARALLEL_RPC_PORT": "13345"}
    line = ["--backend", "vllm", "--data-parallel-size", "4", "--tensor-parallel-size", "4"]
    cfg = dry_run("inference", *line, "--data-parallel-size-local", "2", env=env)
    assert (cfg["data_parallel_address"], cfg["data_parallel_rpc_port"]) == ("10.15.42.1", 13345)
    cfg = dry_run("inference", *line, "--data-parallel-address", "10.0.0.9", "--data-parallel-rpc-port", "1", env=env)
    assert (cfg["data_parallel_address"], cfg["data_parallel_rpc_port"]) == ("10.0.0.9", 1)
    bad = entrypoint("inference", *line, "--dry-run", env={"DATA_PARALLEL_RPC_PORT": "70000"})
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: environment variable DATA_PARALLEL_RPC_PORT='70000' is not a valid --data-parallel-rpc-port"
    ]


# ---- 8. The tmux layout: "bash scripts/tmux.sh ... paste the experiment entrypoints ... in the Trainer pane",
# "Start the inference server in the Inference pane" (readme.md), "a pre-layouted tmux session to view the logs
# from all submodules" (rl-architecture.md): Trainer and Inference are shells, Orchestrator follows its log.


@pytest.fixture
def tmux(tmp_path):
    """`tmux ARGS` on a server of this test's own (its socket under tmp_path), stopped at the end."""
    import shutil

    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (apt-get install tmux)")
    env = {k: v for k, v in os.environ.items() if k != "TMUX"} | {"TMUX_TMPDIR": str(tmp_path)}

    def run(*args: str, cwd: Path = tmp_path) -> subprocess.CompletedProcess:
        return subprocess.run(args, capture_output=True, text=True, cwd=cwd, env=env, stdin=subprocess.DEVNULL)

    yield run
    run("tmux", "kill-server")


def _wait_for(check, timeout: float = 10) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_tmux_layout_has_the_panes_the_docs_type_into(tmux, tmp_path):
    work = tmp_path / "repo"
    work.mkdir()
    started = tmux("bash", str(REPO / "scripts" / "tmux.sh"), "exp-1", cwd=work)  # readme.md:120
    assert started.returncode == 0, started.stderr
    assert "tmux attach -t exp-1" in started.stdout  # not on a terminal: built detached
    panes = tmux("tmux", "list-panes", "-t", "exp-1:RL", "-F", "#{pane_title}|#{pane_start_command}").stdout
    titles = dict(line.split("|", 1) for line in panes.splitlines())
    assert list(titles) == ["Trainer", "Orchestrator", "Inference"]
    assert "tail -F outputs/exp-1/logs/orchestrator.log" in titles["Orchestrator"]
    for pane, name in ((0, "trainer"), (2, "inference")):  # the user's commands run where the docs type them
        tmux("tmux", "send-keys", "-t", f"exp-1:RL.{pane}", f"echo {name}-typed > {name}.txt", "Enter")
        assert _wait_for(lambda n=name: (work / f"{n}.txt").exists()), f"nothing typed ran in the {name} pane"
    (work / "outputs" / "exp-1" / "logs" / "orchestrator.log").write_text("step 1 | reward 0.5\n")
    shown = lambda: "step 1 | reward 0.5" in tmux("tmux", "capture-pane", "-p", "-t", "exp-1:RL.1").stdout  # noqa: E731
    assert _wait_for(shown), "the Orchestrator pane does not show the orchestrator's log"
    assert tmux("bash", str(REPO / "scripts" / "tmux.sh"), "kill", "exp-1").returncode == 0  # readme.md:201
    assert tmux("tmux", "has-session", "-t", "exp-1").returncode != 0


# ---- 9. Inference dtype: '"auto" uses FP16 for FP32/FP16 models, BF16 for BF16 models' (training-and-evaluation-
# guide.md). The embedded engine follows it on a CUDA GPU; on CPU it keeps float32 and logs why (docs/inference.md).


def test_embedded_dtype_auto_on_cpu_keeps_float32_and_says_why(tiny_model_dir, tmp_path, caplog_loguru):
    import json
    import shutil

    import torch

    from asyncrl.config.inference import InferenceConfig
    from asyncrl.inference.engine.engine import EmbeddedEngine

    bf16 = shutil.copytree(tiny_model_dir, tmp_path / "bf16")  # a checkpoint whose config names bfloat16
    config = json.loads((bf16 / "config.json").read_text())
    (bf16 / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16", "torch_dtype": "bfloat16"}))
    for model, named in ((tiny_model_dir, "float32"), (bf16, "bfloat16")):
        caplog_loguru.clear()
        engine = EmbeddedEngine(InferenceConfig(model={"name": str(model)}, device="cpu", backend="embedded"))
        assert engine.dtype == torch.float32
        assert f"dtype auto: {named} checkpoint on cpu: float32 (half precision is slow and inexact there)" in (
            caplog_loguru
        )
    engine = EmbeddedEngine(
        InferenceConfig(model={"name": str(tiny_model_dir), "dtype": "bfloat16"}, device="cpu", backend="embedded")
    )
    assert engine.dtype == torch.bfloat16  # an explicit dtype is what loads


def test_embedded_dtype_auto_on_a_cuda_gpu_is_the_docs_rule():
    import torch

    from asyncrl.inference.engine.engine import auto_dtype

    cuda, f16, bf16, f32 = torch.device("cuda"), torch.float16, torch.bfloat16, torch.float32
    assert auto_dtype(f32, cuda)[0] == f16  # "FP16 for FP32/FP16 models"
    assert auto_dtype(f16, cuda)[0] == f16
    assert auto_dtype(None, cuda)[0] == f16  # a config naming no dtype: transformers loads float32
    assert auto_dtype(bf16, cuda)[0] == bf16  # "BF16 for BF16 models"
    assert auto_dtype(bf16, cuda, bf16_ok=False) == (f16, "bfloat16 checkpoint on a GPU without bfloat16: float16")
    assert auto_dtype(f16, torch.device("cpu"))[0] == f32


# ---- 10. "the --bench flag. It will run each module in isolation for a few steps and log performance statistics
# to the console and, optionally, W&B" (readme.md): `orchestrator @ ... --bench` against a running server writes
# its steps to {output_dir}/metrics/orchestrator.jsonl (kind "bench") and W&B, as `trainer --bench` does.
# 11. `eval` and `synthesize` end without aiohttp's "Unclosed client session / connector" dumps.
# Both against the session's shared `inference` server (tests/conftest.py).


@pytest.mark.slow
def test_orchestrator_bench_writes_its_numbers_to_metrics_and_wandb(shared_inference_process, tmp_path):
    import json

    server = shared_inference_process
    done = entrypoint(
        "orchestrator",
        *("@", "configs/debug/cpu/orchestrator/debug.toml", "--bench"),  # readme.md:259, the CPU twin's config
        *("--model.name", server.model, "--client.base-url", server.url, "--output-dir", str(tmp_path)),
        *("--wandb.offline", "--wandb.project", "bench"),
        env={"WANDB_SILENT": "true"},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "orchestrator bench:" in done.stdout and "Unclosed" not in done.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics" / "orchestrator.jsonl").read_text().splitlines()]
    assert [(r["step"], r["kind"]) for r in rows] == [(0, "bench"), (1, "bench")]  # max_steps = 2 in the config
    for row in rows:
        assert row["rollouts"] == 16 and row["errors"] == 0  # 4 prompts x 4 rollouts
        assert row["perf/rollouts_per_s"] > 0 and row["perf/gen_tokens_per_s"] > 0 and row["time/rollouts"] > 0
    (run,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    assert b"perf/rollouts_per_s" in run.read_bytes()


# `eval`/`synthesize` in one process, then what is left open once they return: the dump is printed only when the
# garbage collector reaches an unclosed session while a loop still runs, so count them instead of hoping for it.
OPEN_CLIENTS = """
import gc, importlib, json, sys
import aiohttp, httpx
try:
    importlib.import_module("asyncrl.entrypoints." + sys.argv[1]).main(sys.argv[2:])
except SystemExit as e:
    assert not e.code, e.code
gc.collect()
live = gc.get_objects()
print(json.dumps({
    "aiohttp sessions": sum(isinstance(o, aiohttp.ClientSession) and not o.closed for o in live),
    "aiohttp connectors": sum(isinstance(o, aiohttp.BaseConnector) and not o.closed for o in live),
    "httpx clients": sum(isinstance(o, httpx.AsyncClient) and not o.is_closed for o in live),
}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("command", ["eval", "synthesize"])
def test_eval_and_synthesize_close_their_clients(shared_inference_process, tmp_path, command):
    import json

    server = shared_inference_process
    done = server.run_client(
        [sys.executable, "-c", OPEN_CLIENTS, command],
        tmp_path,
        *("--environment-ids", "reverse-text,tool-calc", "--num-examples", "2"),  # tool-calc: its MCP tool server too
        *("--rollouts-per-example", "2", "--sampling.max-tokens", "8"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "nclosed" not in done.stderr, done.stderr[-3000:]
    left = json.loads(done.stdout.strip().splitlines()[-1])
    assert left == {"aiohttp sessions": 0, "aiohttp connectors": 0, "httpx clients": 0}
