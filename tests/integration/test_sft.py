"""`sft` end to end on CPU: loss goes down on reverse-text, the output serves, resume is exact, ranks agree."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from server_proc import ServerProcess

from tests import warm

pytestmark = pytest.mark.slow

SFT = [sys.executable, "-m", "asyncrl.entrypoints.sft"]


@pytest.fixture(scope="module")
def reverse_data(tmp_path_factory) -> Path:
    from reverse_text import sft_examples, write_jsonl

    return write_jsonl(tmp_path_factory.mktemp("sft_data") / "reverse.jsonl", sft_examples(2000, seed=0))


def sft_args(model_dir: Path, data: Path, out: Path, steps: int, *extra: str) -> list[str]:
    return [
        "--model.name",
        str(model_dir),
        "--data.name",
        str(data),
        "--output-dir",
        str(out),
        "--data.seq-len",
        "256",
        "--data.batch-size",
        "4",
        "--data.micro-batch-size",
        "2",
        "--optim.lr",
        "3e-3",
        "--max-steps",
        str(steps),
        "--device",
        "cpu",
        *extra,
    ]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics" / "sft.jsonl").read_text().splitlines()]


def test_a_terminal_gets_a_live_bar_and_a_pipe_plain_lines(tiny_model_dir, reverse_data, tmp_path, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("ASYNCRL_PROGRESS", "auto")
    monkeypatch.setenv("COLUMNS", "150")
    cmd = SFT + sft_args(tiny_model_dir, reverse_data, tmp_path / "tty", 4, "--no-report")
    on_tty = subprocess.run(["script", "-qfec", shlex.join(cmd), "/dev/null"], capture_output=True, text=True)
    assert on_tty.returncode == 0, on_tty.stdout[-3000:]
    assert "4/4" in on_tty.stdout and "━" in on_tty.stdout and "tok/s" in on_tty.stdout  # the bar, at its end
    assert "step 3 | loss" in on_tty.stdout and "SFT done after 4 steps" in on_tty.stdout  # the log lines too
    cmd = SFT + sft_args(tiny_model_dir, reverse_data, tmp_path / "pipe", 4, "--no-report")
    piped = warm.run(cmd, capture_output=True, text=True)
    assert piped.returncode == 0, piped.stderr[-3000:]
    assert "step 3 | loss" in piped.stderr and "━" not in piped.stderr + piped.stdout  # plain lines only


def test_sft_lowers_loss_and_its_weights_serve(tiny_model_dir, reverse_data, tmp_path):
    out = tmp_path / "run"
    done = warm.run(SFT + sft_args(tiny_model_dir, reverse_data, out, 16), capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(16))  # 0-based, as in the RL trainer
    first = sum(r["loss"] for r in rows[:3]) / 3
    last = sum(r["loss"] for r in rows[-3:]) / 3
    assert last < first - 0.8, [round(r["loss"], 3) for r in rows]
    assert all(r["loss_tokens"] > 0 and r["tokens"] > r["loss_tokens"] for r in rows)  # prompts are masked
    weights = out / "weights" / "step_16"
    assert (weights / "STABLE").exists() and (weights / "config.json").exists()
    assert "step 15 | loss" in done.stderr
    assert "<figcaption>SFT loss</figcaption>" in (out / "report.html").read_text()  # sft writes its report
    server = ServerProcess(weights, tmp_path / "serve")
    try:
        reply = server.chat("Reverse the text: hello")
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["role"] == "assistant"
    finally:
        server.stop()


def test_sft_resume_mid_epoch_is_exact(tiny_model_dir, reverse_data, tmp_path):
    from asyncrl.config.loader import validate
    from asyncrl.config.sft import SFTConfig
    from asyncrl.trainer.sft import train_sft as train_sft_in
    from asyncrl.transport.layout import RunLayout

    train_sft = lambda cfg: train_sft_in(cfg, RunLayout.for_config(cfg))  # noqa: E731  (as its entrypoint runs it)

    def config(out: Path, *extra: str) -> SFTConfig:
        from asyncrl.config.loader import collect_raw

        raw, _ = collect_raw(SFTConfig, sft_args(tiny_model_dir, reverse_data, out, 4, *extra))
        return validate(SFTConfig, raw)

    full = train_sft(config(tmp_path / "full"))
    out = tmp_path / "split"
    train_sft(config(out, "--ckpt", "--ckpt.interval", "2", "--max-steps", "2"))
    assert (out / "checkpoints" / "step_2" / "trainer" / "STABLE").exists()
    progress = json.loads((out / "checkpoints" / "step_2" / "trainer" / "progress.json").read_text())
    assert progress["data"]["epoch"] == 0 and 0 < progress["data"]["index"] < 2000  # mid-epoch
    resumed = train_sft(config(out, "--ckpt.resume-step", "2", "--ckpt.interval", "2"))
    assert [m["loss"] for m in resumed] == pytest.approx([m["loss"] for m in full[2:]], rel=1e-5)
    assert [m["data_index"] for m in resumed] == [m["data_index"] for m in full[2:]]
    assert (out / "weights" / "step_2").is_dir() and (out / "weights" / "step_4").is_dir()

    # a checkpoint torn on disk: resuming from it is a one-line error naming it, and nothing is trained
    shard = next((out / "checkpoints" / "step_2" / "trainer").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    cmd = SFT + sft_args(tiny_model_dir, reverse_data, out, 4, "--ckpt.resume-step", "2", "--no-report")
    torn = warm.run(cmd, capture_output=True, text=True)
    assert torn.returncode == 2, torn.stderr[-2000:]
    assert f"checkpoint {out / 'checkpoints' / 'step_2' / 'trainer'} is corrupted" in torn.stderr.splitlines()[-1]
    assert "Traceback" not in torn.stderr


def test_micro_batch_size_does_not_change_the_step(tiny_model_dir, reverse_data, tmp_path):
    """Rows stacked into one padded micro-batch give the loss and gradient of one row at a time."""
    from asyncrl.config.sft import SFTConfig
    from asyncrl.trainer.sft import train_sft as train_sft_in
    from asyncrl.transport.layout import RunLayout

    train_sft = lambda cfg: train_sft_in(cfg, RunLayout.for_config(cfg))  # noqa: E731  (as its entrypoint runs it)

    def run(mbs: int, pack: bool) -> list[dict]:
        return train_sft(
            SFTConfig(
                model={"name": str(tiny_model_dir)},
                data={
                    "name": str(reverse_data),
                    "seq_len": 200,
                    "batch_size": 4,
                    "micro_batch_size": mbs,
                    "pack": pack,
                },
                optim={"lr": 3e-3},
                max_steps=2,
                output_dir=tmp_path / f"{mbs}-{pack}",
                device="cpu",
            )
        )

    for pack in (True, False):
        one, four = run(1, pack), run(4, pack)
        assert [m["loss"] for m in four] == pytest.approx([m["loss"] for m in one], rel=1e-5)
        assert [m["grad_norm"] for m in four] == pytest.approx([m["grad_norm"] for m in one], rel=1e-4)
        assert all((m["samples"] > m["rows"]) if pack else (m["samples"] == m["rows"] == 4) for m in one)


@pytest.mark.parametrize("tp", ["1", "2"], ids=["fsdp", "tensor-parallel"])
def test_sft_two_ranks_match_one(tiny_model_dir, reverse_data, tmp_path, tp):
    """2 FSDP2 ranks (data split), or 2 tensor-parallel ranks (`--model.tp 2`: each layer split), train as 1."""
    args = ("--data.micro-batch-size", "1", "--log.level", "warning")
    one = warm.run(
        SFT + sft_args(tiny_model_dir, reverse_data, tmp_path / "one", 3, *args),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stderr[-2000:]
    two = warm.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "-m",
            "asyncrl.entrypoints.sft",
            *sft_args(tiny_model_dir, reverse_data, tmp_path / "two", 3, *args, "--model.tp", tp),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    assert [m["loss"] for m in metrics(tmp_path / "two")] == pytest.approx(
        [m["loss"] for m in metrics(tmp_path / "one")], rel=1e-4
    )
    assert (tmp_path / "two" / "logs" / "sft_rank1.log").exists()


def test_sft_bench_on_fake_data(tiny_model_dir, tmp_path):
    done = warm.run(
        SFT
        + [
            "--model.name",
            str(tiny_model_dir),
            "--data.type",
            "fake",
            "--bench",
            "--data.seq-len",
            "128",
            "--data.batch-size",
            "4",
            "--data.micro-batch-size",
            "2",
            "--output-dir",
            str(tmp_path),
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "bench | tokens/s" in done.stdout and "MFU" in done.stdout, done.stdout
    rows = metrics(tmp_path)
    assert len(rows) == 5 and len({r["tokens"] for r in rows}) > 1  # variable-length samples
    assert not (tmp_path / "weights").exists()  # a benchmark writes no weights
