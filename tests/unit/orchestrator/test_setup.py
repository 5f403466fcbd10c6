"""Environment loading errors, sampling args, server client errors, checkpoint/resume of progress."""

import asyncio
import json

import pytest
from orch_fakes import FakeRunner, FakeServer, fake_mixture

from asyncrl.config.base import CkptConfig
from asyncrl.config.orchestrator import ClientConfig, EnvConfig, OrchestratorConfig, SamplingConfig
from asyncrl.core.errors import UserError
from asyncrl.orchestrator import ckpt
from asyncrl.orchestrator.client import InferenceClient, server_root
from asyncrl.orchestrator.envs.loading import load_env
from asyncrl.orchestrator.envs.runners import sampling_args
from asyncrl.orchestrator.loop import Orchestrator
from asyncrl.transport.files import publish_dir
from asyncrl.transport.layout import RunLayout


def test_missing_env_errors_say_how_to_install():
    with pytest.raises(UserError, match=r"prime env install someone/no-such-env"):
        load_env(EnvConfig(id="someone/no-such-env"))
    with pytest.raises(UserError, match=r"not installed.*pip install"):
        load_env(EnvConfig(id="no-such-env-xyz"))


def test_sampling_args_keep_ratios_exact_and_refuse_duplicates():
    args = sampling_args(SamplingConfig(temperature=0.7, max_tokens=16, seed=3))
    assert args["temperature"] == 0.7 and args["top_p"] == 1.0 and args["max_tokens"] == 16
    assert args["extra_body"] == {"top_k": -1, "min_p": 0.0} and "seed" not in args
    assert sampling_args(SamplingConfig(seed=3), with_seed=True)["seed"] == 3
    assert (
        sampling_args(SamplingConfig(extra_body={"repetition_penalty": 1.1}))["extra_body"]["repetition_penalty"] == 1.1
    )
    with pytest.raises(UserError, match="top_p"):
        sampling_args(SamplingConfig(extra_body={"top_p": 0.9}))


def test_unreachable_server_error_names_the_url():
    assert server_root("http://h:1/v1/") == "http://h:1" and server_root("http://h:1") == "http://h:1"
    client = InferenceClient(ClientConfig(port=9))  # nothing listens on the discard port

    async def go():
        try:
            await client.wait_healthy(timeout=0.3, poll=0.1)
        finally:
            await client.close()

    with pytest.raises(UserError, match=r"http://localhost:9 not reachable.*inference"):
        asyncio.run(go())


def _orchestrator(cfg: OrchestratorConfig, run_group, server) -> Orchestrator:
    return Orchestrator(cfg, fake_mixture(), run_group, server, layout=RunLayout.for_config(cfg))


def _config(tmp_path, k=1, **kw):
    kw.setdefault("num_train_workers", 1)
    return OrchestratorConfig(
        batch_size=8, rollouts_per_example=4, seq_len=64, output_dir=tmp_path, max_async_level=k, **kw
    )


def _publish(out, step):
    publish_dir(RunLayout(out).broadcast_dir(step), lambda d: (d / "config.json").write_text("{}"))


@pytest.mark.parametrize("where", ["default", "ckpt.path"])
def test_checkpoint_and_resume_continue_where_the_run_stopped(tmp_path, where):
    path = {"default": "checkpoints", "ckpt.path": tmp_path / "elsewhere" / "ckpts"}[where]
    saved = RunLayout(tmp_path, path)
    cfg = _config(tmp_path, k=3, max_steps=4, ckpt=CkptConfig(path=path, interval=2, keep_last=1))  # never waits
    orch = Orchestrator(cfg, fake_mixture(), FakeRunner(), FakeServer(), layout=RunLayout.for_config(cfg))
    asyncio.run(orch.run())
    assert ckpt.saved_steps(saved) == [4]  # step 2 saved, then pruned by keep_last=1
    assert (tmp_path / "checkpoints").exists() == (where == "default")
    progress, buffer = ckpt.load(saved, 4)
    assert progress.step == 4 and progress.total_samples == 32 and progress.total_problems == 8
    assert progress.sampler["problems"] == orch.mixture.problems

    # Resume from step 4: weights/step_4 is the trainer's checkpoint, newer than any broadcast dir.
    stale_batch = RunLayout(tmp_path).batch_dir(5)
    stale_batch.mkdir(parents=True)
    _publish(tmp_path, 6)  # left from an earlier attempt beyond the resume point
    w = RunLayout(tmp_path).weights_dir(4)
    w.mkdir(parents=True)
    (w / "config.json").write_text("{}")
    server = FakeServer()
    cfg2 = _config(tmp_path, max_steps=5, ckpt=CkptConfig(path=path, interval=2, resume_step=-1))
    orch2 = Orchestrator(cfg2, fake_mixture(), FakeRunner(), server, layout=RunLayout.for_config(cfg2))
    asyncio.run(orch2.run())
    assert not RunLayout(tmp_path).broadcast_dir(6).exists()
    assert server.calls[0][:2] == ("update", str(w))  # the server is pointed at the checkpoint weights itself
    assert orch2.mixture.problems == progress.sampler["problems"] + 2
    records = [json.loads(line) for line in (tmp_path / "metrics" / "orchestrator.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert records[-1]["progress/total_samples"] == 40 and records[-1]["policy/step"] == 4
    assert (RunLayout(tmp_path).batch_dir(4) / "meta.json").exists() and not stale_batch.exists()
    assert ckpt.saved_steps(saved) == [4, 5]  # final step always saved


def test_resume_without_checkpoint_is_a_user_error(tmp_path):
    cfg = _config(tmp_path, max_steps=2, ckpt=CkptConfig(resume_step=3))
    with pytest.raises(UserError, match="no orchestrator checkpoint"):
        asyncio.run(_orchestrator(cfg, FakeRunner(), FakeServer()).run())


def test_dead_server_during_rollouts_is_reported_as_such(tmp_path):
    runner = FakeRunner(error_fn=lambda *a: "ModelError(APIConnectionError)")
    cfg = _config(tmp_path, max_steps=2)
    orch = Orchestrator(cfg, fake_mixture(), runner, FakeServer(healthy=False), layout=RunLayout.for_config(cfg))
    with pytest.raises(UserError, match="stopped answering"):
        asyncio.run(orch.run())


def test_rollouts_cut_short_by_a_full_context_are_counted_and_explained(tmp_path, caplog_loguru):
    full = lambda slot, row, i: "prompt_too_long" if i < 2 else "has_final_answer"  # noqa: E731
    cfg = _config(tmp_path, max_steps=2)
    orch = Orchestrator(cfg, fake_mixture(), FakeRunner(stop_fn=full), FakeServer(), layout=RunLayout.for_config(cfg))
    asyncio.run(orch.run())
    records = [json.loads(line) for line in (tmp_path / "metrics" / "orchestrator.jsonl").read_text().splitlines()]
    assert [r["context_full/frac"] for r in records] == [0.5, 0.5]  # 2 of each group of 4
    warnings = [m for m in caplog_loguru if "did not fit the context" in m]
    assert len(warnings) == 1 and "raise seq_len or lower sampling.max_tokens" in warnings[0]  # once per 10 steps


@pytest.mark.slow
def test_wandb_offline_logging(tmp_path):
    pytest.importorskip("wandb")
    from asyncrl.config.base import WandbConfig

    cfg = _config(
        tmp_path, k=2, max_steps=2, wandb=WandbConfig(offline=True, name="t-orchestrator", log_extras={"interval": 1})
    )
    asyncio.run(_orchestrator(cfg, FakeRunner(), FakeServer()).run())
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0


@pytest.mark.parametrize("share", [True, False])
def test_share_prefix_reaches_the_packed_batch_and_its_metrics(tmp_path, share):
    from asyncrl.transport.batch import read_batch, read_meta
    from asyncrl.transport.prefix import check_shared, segments

    cfg = _config(tmp_path, k=3, max_steps=1, share_prefix=share)
    asyncio.run(_orchestrator(cfg, FakeRunner(turns=2), FakeServer()).run())
    rows = read_batch(RunLayout(tmp_path), 0, 0)
    meta = read_meta(RunLayout(tmp_path), 0)
    (record,) = [json.loads(line) for line in (tmp_path / "metrics" / "orchestrator.jsonl").read_text().splitlines()]
    # 2 groups x 4 rollouts of one interleaved sample: 4 prompt + 3 + 2 env + 2 tokens each
    assert meta["num_tokens_unshared"] == record["batch/tokens_unshared"] == 8 * 11
    assert meta["num_tokens"] == record["batch/tokens"] == sum(len(mb.input_ids) for mb in rows)
    assert meta["num_tokens"] == (2 * (4 + 4 * 7) if share else 8 * 11)
    assert record["batch/shared_frac"] == pytest.approx(1 - meta["num_tokens"] / meta["num_tokens_unshared"])
    assert any(segments(mb.position_ids).shared for mb in rows) == share
    for mb in rows:
        check_shared(mb.position_ids, mb.loss_mask)
    assert sum(segments(mb.expanded().position_ids).num_samples for mb in rows) == 8


def test_without_num_train_workers_batches_are_packed_for_the_trainers_world_size(tmp_path, caplog_loguru):
    from asyncrl.transport.batch import read_meta

    cfg = _config(tmp_path, k=3, max_steps=2, num_train_workers=None)
    world = RunLayout(tmp_path).trainer_world
    world.write_text(json.dumps({"world_size": 2}))  # what trainer rank 0 writes at start
    asyncio.run(_orchestrator(cfg, FakeRunner(), FakeServer()).run())
    assert read_meta(RunLayout(tmp_path), 1)["num_ranks"] == 2
    assert [m for m in caplog_loguru if "trainer rank(s)" in m] == [
        f"packing batches for 2 trainer rank(s) (from {world})"
    ]


def test_without_num_train_workers_or_a_trainer_batches_are_packed_for_one_rank(tmp_path, caplog_loguru):
    from asyncrl.transport.batch import read_meta

    cfg = _config(tmp_path, k=3, max_steps=1, num_train_workers=None)
    asyncio.run(_orchestrator(cfg, FakeRunner(), FakeServer()).run())
    assert read_meta(RunLayout(tmp_path), 0)["num_ranks"] == 1
    assert "packing batches for 1 trainer rank(s) (until the trainer writes trainer_world.json)" in caplog_loguru
