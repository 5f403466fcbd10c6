"""On-policy distillation in the orchestrator: config, the per-token advantage arithmetic, the teacher client
against a real teacher (teacher_server.py: a tiny HF model answering vLLM's prompt_logprobs shape) and its error
paths, scoring in parallel with rollouts, metrics, and resume re-checking the teacher."""

import asyncio
import json
import time

import pytest
import torch
from orch_fakes import FakeRunner, FakeServer, fake_mixture
from teacher_server import TeacherServer

from asyncrl.config.base import CkptConfig
from asyncrl.config.orchestrator import (
    AdvantageConfig,
    BufferConfig,
    DistillConfig,
    OrchestratorConfig,
    TeacherConfig,
)
from asyncrl.core.errors import UserError
from asyncrl.orchestrator import teacher as teacher_mod
from asyncrl.orchestrator.advantage import teacher_targets, token_advantages
from asyncrl.orchestrator.batches import step_items
from asyncrl.orchestrator.loop import Orchestrator
from asyncrl.orchestrator.packing import PackItem, pack
from asyncrl.orchestrator.rollouts import GroupCollector
from asyncrl.orchestrator.samples import TeacherScores, TokenSample, TrajectoryConverter
from asyncrl.orchestrator.teacher import PROBE, DenseTeacher, TeacherClient
from asyncrl.transport.batch import read_batch
from asyncrl.transport.layout import RunLayout
from tests import warm


class StudentServer(FakeServer):
    """The fake student server, with a /tokenize answered by the tiny model's tokenizer."""

    def __init__(self, tok, **kw):
        super().__init__(**kw)
        self.tok = tok

    async def tokenize(self, model, text):
        return {"tokens": self.tok.encode(text, add_special_tokens=True)}


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def quick_retries(monkeypatch):
    monkeypatch.setattr(teacher_mod, "BACKOFF_S", 0.01)


def _config(tmp_path, teacher_url=None, **kw):
    kw.setdefault("num_train_workers", 1)
    if teacher_url is not None:
        kw["teacher"] = {"base_url": teacher_url, **kw.pop("teacher", {})}
    return OrchestratorConfig(batch_size=8, rollouts_per_example=4, seq_len=64, output_dir=tmp_path, **kw)


def _records(tmp_path):
    return [json.loads(line) for line in (tmp_path / "metrics" / "orchestrator.jsonl").read_text().splitlines()]


def _orchestrator(config: OrchestratorConfig, run_group, server, **kw) -> Orchestrator:
    return Orchestrator(config, fake_mixture(), run_group, server, layout=RunLayout.for_config(config), **kw)


def _teacher(config: OrchestratorConfig) -> TeacherClient:
    return TeacherClient(config.teacher, config.seq_len)


# ---- config ---------------------------------------------------------------------------------------------------
def test_config_weights_and_errors():
    plain = OrchestratorConfig()
    assert (plain.teacher, plain.reward_weight, plain.distill_weight) == (None, 1.0, 0.0)
    distilled = OrchestratorConfig(teacher={"port": 8001})
    assert (distilled.reward_weight, distilled.distill_weight, distilled.teacher.model) == (0.0, 1.0, None)
    mixed = OrchestratorConfig(teacher={"port": 8001}, reward={"weight": 0.5}, distill={"weight": 2.0})
    assert (mixed.reward_weight, mixed.distill_weight) == (0.5, 2.0)
    with pytest.raises(ValueError, match=r"nothing to learn from"):
        OrchestratorConfig(reward={"weight": 0})
    with pytest.raises(ValueError, match=r"nothing to learn from"):
        OrchestratorConfig(teacher={"port": 8001}, distill={"weight": 0})
    with pytest.raises(ValueError, match=r"distill.weight = 0.5 .*\[orchestrator.teacher\]"):
        OrchestratorConfig(distill={"weight": 0.5})
    with pytest.raises(ValueError, match=r"student's own server"):
        OrchestratorConfig(teacher={})
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        OrchestratorConfig(teacher={"port": 8001}, reward={"weight": -1})
    with pytest.raises(ValueError, match=r"forward_kl' needs .* set distill.top_k"):
        OrchestratorConfig(teacher={"port": 8001}, distill={"kind": "forward_kl"})
    # a config dumped and read back (rl hands the orchestrator its config so) stays valid
    assert OrchestratorConfig.model_validate(plain.model_dump(mode="json")).reward_weight == 1.0


def test_config_errors_on_the_command_line_are_one_line(tmp_path):
    import sys

    run = warm.run(
        [sys.executable, "-m", "asyncrl.entrypoints.orchestrator", "--distill.weight", "0.3"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert run.returncode == 2 and "[orchestrator.teacher]" in run.stderr
    assert "Traceback" not in run.stderr


# ---- advantages -----------------------------------------------------------------------------------------------
def test_token_advantages_pure_mixed_and_masked():
    mask = [False, False, True, True, False, True]
    sampler = [0.0, 0.0, -1.0, -2.0, 0.0, -0.5]
    teacher = [0.0, -3.0, -0.5, -2.5, -9.0, -0.25]
    pure = token_advantages(mask, sampler, teacher, reward_advantage=0.7, distill_weight=1.0, reward_weight=0.0)
    assert pure == [0.0, 0.0, 0.5, -0.5, 0.0, 0.25]  # teacher - sampler on loss tokens only
    mixed = token_advantages(mask, sampler, teacher, reward_advantage=0.5, distill_weight=2.0, reward_weight=0.5)
    assert mixed == [0.0, 0.0, 1.25, -0.75, 0.0, 0.75]
    short = token_advantages(mask, sampler, teacher[:4], reward_advantage=0.5, distill_weight=1.0, reward_weight=1.0)
    assert short == [0.0, 0.0, 1.0, 0.0, 0.0, 0.5]  # unscored tail: the reward term alone


def test_the_baseline_is_added_to_the_distillation_term_only():
    mask = [False, True, True]
    sampler, teacher, kl = [0.0, -1.0, -2.0], [0.0, -0.5, -2.5], [0.0, 0.25, 0.75]
    got = token_advantages(mask, sampler, teacher, 0.5, distill_weight=2.0, reward_weight=1.0, baseline=kl)
    assert got == [0.0, 2.0 * (0.5 + 0.25) + 0.5, 2.0 * (-0.5 + 0.75) + 0.5]


def test_the_distillation_term_is_clamped_not_the_reward_term():
    mask = [False, True, True]
    sampler, teacher = [0.0, -0.1, -0.2], [0.0, -9.1, -0.7]
    got = token_advantages(mask, sampler, teacher, 0.5, distill_weight=1.0, reward_weight=1.0, clip=3.0)
    assert got == pytest.approx([0.0, -3.0 + 0.5, -0.5 + 0.5])


def test_reverse_kl_from_both_top_k():
    """sum over the student's listed tokens of s(x)(log s(x) - log t(x)); one the teacher lacks takes its floor."""
    import math

    def entry(**lps):
        return {x.removeprefix("t"): {"logprob": lp, "rank": 1} for x, lp in lps.items()}

    ln = math.log
    student = [None, entry(t1=ln(0.6), t2=ln(0.4)), entry(t1=ln(0.9), t3=ln(0.1))]
    teacher = [None, entry(t1=ln(0.99), t2=ln(0.01)), entry(t1=ln(0.5), t2=ln(0.2), t4=float("-inf"))]
    got = teacher_mod.reverse_kl(student, teacher)
    first = 0.6 * ln(0.6 / 0.99) + 0.4 * ln(0.4 / 0.01)
    second = 0.9 * ln(0.9 / 0.5) + 0.1 * ln(0.1 / 0.2)  # token 3: the teacher's lowest finite listed logprob
    assert got == pytest.approx([0.0, first, second])


def test_teacher_targets_renormalize_the_listed_tokens_on_loss_tokens_only():
    import math

    top = [{}, {3: math.log(0.6), 4: math.log(0.2)}, {5: 0.0}, {6: -1.0}]
    got = teacher_targets([False, True, True, False], top, weight=2.0)
    assert got[0] == {} and got[3] == {}  # not loss tokens
    assert got[1] == pytest.approx({3: 1.5, 4: 0.5}) and got[2] == pytest.approx({5: 2.0})
    assert teacher_targets([False, True, True], top[:2], 1.0)[2] == {}  # past what the teacher scored


def test_teacher_targets_survive_truncation_shared_prefixes_and_fillers():
    a = TokenSample([1, 2, 3, 4], [False, False, True, True], [0, 0, -1.0, -1.0])
    b = TokenSample([1, 2, 3, 7], [False, False, True, True], [0, 0, -1.0, -1.0])
    ta = [{}, {}, {3: 0.5, 9: 0.5}, {4: 1.0}]
    tb = [{}, {}, {3: 1.0}, {7: 0.25, 8: 0.25, 9: 0.5}]
    items = [PackItem(a, 0.0, 1.0, group=0, teacher_targets=ta), PackItem(b, 0.0, 1.0, group=0, teacher_targets=tb)]
    rows, stats = pack(items, seq_len=16, num_ranks=2, share=True)
    assert stats.num_tokens < stats.num_tokens_unshared and stats.num_dummies == 1
    full = rows[0][0].expanded()
    assert full.teacher_ids.shape == (8, 3)  # the widest position lists 3
    mass = {(t, int(i)): float(w) for t in range(8) for i, w in zip(full.teacher_ids[t], full.teacher_targets[t])}
    assert {k: v for k, v in mass.items() if v} == {(2, 3): 0.5, (2, 9): 0.5, (3, 4): 1.0, (6, 3): 1.0,
                                                      (7, 7): 0.25, (7, 8): 0.25, (7, 9): 0.5}  # fmt: skip
    assert not rows[1][0].teacher_targets.any() and rows[1][0].teacher_ids.shape[1] == 3  # the filler
    cut, _ = pack(items[:1], seq_len=3)
    assert cut[0][0].teacher_targets.sum(-1).tolist() == [0, 0, 1.0]
    plain, _ = pack([PackItem(a, 0.0, 1.0)], seq_len=16)
    assert plain[0][0].teacher_ids is None  # reverse_kl and reward batches: the fields of before


def test_per_token_advantages_survive_truncation_and_shared_prefixes():
    a = TokenSample([1, 2, 3, 4, 5], [False, False, True, True, True], [0, 0, -1.0, -1.0, -1.0])
    b = TokenSample([1, 2, 3, 7, 8], [False, False, True, True, True], [0, 0, -1.0, -1.0, -1.0])
    items = [
        PackItem(a, 0.0, 1.0, group=0, token_advantages=[0, 0, 0.1, 0.2, 0.3]),
        PackItem(b, 0.0, 1.0, group=0, token_advantages=[0, 0, 0.4, 0.5, 0.6]),
    ]
    rows, stats = pack(items, seq_len=16, share=True)
    assert stats.num_tokens < stats.num_tokens_unshared  # the prompt [1, 2] is packed once
    adv = rows[0][0].expanded().advantages.tolist()
    assert adv == pytest.approx([0, 0, 0.1, 0.2, 0.3, 0, 0, 0.4, 0.5, 0.6])
    cut, _ = pack(items[:1], seq_len=4)
    assert cut[0][0].advantages.tolist() == pytest.approx([0, 0, 0.1, 0.2])


def test_without_a_teacher_batches_are_exactly_todays(tmp_path):
    """No teacher: the packed rows equal the reward-advantage packing (per-sample scalar on every token)."""
    for reward in ({}, {"reward": {"weight": 1.0}}):
        orch = _orchestrator(_config(tmp_path, **reward), FakeRunner(), FakeServer())
        got = asyncio.run(orch.collector.collect(0, 0, 1, orch.problems, orch.in_flight, orch.args))
        new, _ = pack(step_items(got.groups, orch.config), orch.config.seq_len, 1, share=orch.config.share_prefix)
        valid = [(i, r) for i, g in enumerate(got.groups) for r in g.valid]
        old_items = [PackItem(s, r.advantage, 1.0, group=i) for i, r in valid for s in r.samples]
        old, _ = pack(old_items, 64, 1, share=True)
        assert all(s.teacher is None for g in got.groups for s in g.samples) and len(new[0]) == len(old[0])
        for x, y in ((a.to_wire(), b.to_wire()) for a, b in zip(new[0], old[0])):
            assert x.keys() == y.keys()
            assert all(x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in x)
    half = _orchestrator(_config(tmp_path, reward={"weight": 0.5}), FakeRunner(), FakeServer())
    got = asyncio.run(half.collector.collect(0, 0, 1, half.problems, half.in_flight, half.args))
    items = step_items(got.groups, half.config)
    assert [it.advantage for it in items] == [0.5 * r.advantage for g in got.groups for r in g.valid]


# ---- the teacher client ---------------------------------------------------------------------------------------
def test_connect_discovers_the_model_and_scores_like_the_model(tiny_model_dir, tok):
    with TeacherServer(tiny_model_dir, name="the-teacher", max_model_len=8) as srv:
        client = TeacherClient(TeacherConfig(base_url=srv.base_url), seq_len=64)

        async def go():
            try:
                await client.connect(tok.encode(PROBE, add_special_tokens=True), "student")
                sample = TokenSample([5, 6, 7, 8, 9, 10, 11, 12, 13], [False] * 3 + [True] * 6, [-1.0] * 9)
                return await client.score(sample)
            finally:
                await client.close()

        lps = asyncio.run(go())
        assert client.model == "the-teacher" and client.max_model_len == 8
        assert srv.requests[0][1] == [5, 6, 7, 8, 9, 10, 11]  # context 8, less the generated token
        want = srv.logprobs([5, 6, 7, 8, 9, 10, 11])
        assert lps.logprobs == pytest.approx([0.0] * 3 + want[3:], abs=1e-5)  # from the first loss token on
        assert client.unscored_tokens == 2


def test_with_top_k_the_student_server_scores_too_and_gives_the_baseline(tmp_path, tiny_model_dir, tok):
    from asyncrl.config.orchestrator import ClientConfig
    from asyncrl.utils.tiny_model import build_tiny_model

    other = build_tiny_model(tmp_path / "student", hidden_size=64, num_layers=1, seed=1)
    with TeacherServer(tiny_model_dir) as t, TeacherServer(other, name="the-student") as s:
        client = teacher_mod.teacher_client(
            TeacherConfig(base_url=t.base_url),
            64,
            DistillConfig(top_k=5),
            ClientConfig(base_url=s.base_url),
            "the-student",
        )
        ids = [5, 6, 7, 8, 9, 10]
        sample = TokenSample(ids, [False] * 2 + [True] * 4, [-1.0] * 6)

        async def go():
            try:
                return await client.score(sample), await teacher_mod.teacher_client(
                    TeacherConfig(base_url=t.base_url),
                    64,
                    DistillConfig(),
                    ClientConfig(base_url=s.base_url),
                    "the-student",
                ).score(sample)
            finally:
                await client.close()

        scores, plain = asyncio.run(go())
        want_lp = [0.0] * 2 + t.logprobs(ids)[2:]  # from the first loss token on
        assert [r[1] for r in s.requests] == [ids] and scores.logprobs == pytest.approx(want_lp, abs=1e-5)
        assert (
            plain.logprobs == pytest.approx(scores.logprobs, abs=1e-6)
            and plain.baseline is None
            and len(s.requests) == 1
        )
        student_lp, teacher_lp = s.distributions(ids), t.distributions(ids)
        want = [0.0] * 2
        for pos in range(2, len(ids)):
            s_row, t_row = student_lp[pos - 1], teacher_lp[pos - 1]
            listed_s = set(s_row.topk(5).indices.tolist()) | {ids[pos]}
            listed_t = set(t_row.topk(5).indices.tolist()) | {ids[pos]}
            floor = min(t_row[x].item() for x in listed_t)
            want.append(
                sum(
                    s_row[x].exp().item() * (s_row[x].item() - (t_row[x].item() if x in listed_t else floor))
                    for x in listed_s
                )
            )
        assert scores.baseline == pytest.approx(want, abs=1e-5) and all(k > 0 for k in want[2:])


def test_the_baseline_keeps_to_the_student_servers_context(tiny_model_dir, tok):
    from asyncrl.config.orchestrator import ClientConfig

    with TeacherServer(tiny_model_dir) as t, TeacherServer(tiny_model_dir, name="s", max_model_len=5) as s:
        client = teacher_mod.teacher_client(
            TeacherConfig(base_url=t.base_url), 64, DistillConfig(top_k=3), ClientConfig(base_url=s.base_url), "s"
        )
        ids = [5, 6, 7, 8, 9, 10, 11]

        async def go():
            try:
                await client.connect(tok.encode(PROBE, add_special_tokens=True), "student")
                return await client.score(TokenSample(ids, [False] * 2 + [True] * 5, [-1.0] * 7))
            finally:
                await client.close()

        scores = asyncio.run(go())
    assert client.student.max_model_len == 5 and s.requests[-1][1] == ids[:4] and t.requests[-1][1] == ids
    assert len(scores.logprobs) == len(scores.baseline) == 7 and scores.baseline[4:] == [0.0] * 3
    assert scores.baseline[1:4] == pytest.approx([0.0] * 3, abs=1e-5)  # the same model: no KL where both scored


def test_forward_kl_lists_the_teachers_top_k_and_asks_no_student(tiny_model_dir):
    with TeacherServer(tiny_model_dir) as t:
        client = teacher_mod.teacher_client(
            TeacherConfig(base_url=t.base_url), 64, DistillConfig(kind="forward_kl", top_k=3), None, "unused"
        )
        ids = [5, 6, 7, 8, 9]
        sample = TokenSample(ids, [False] * 2 + [True] * 3, [-1.0] * 5)

        async def go():
            try:
                return await client.score(sample)
            finally:
                await client.close()

        scores = asyncio.run(go())
        dist = t.distributions(ids)
    assert client.student is None and scores.logprobs == pytest.approx([0.0] * 2 + t.logprobs(ids)[2:], abs=1e-5)
    assert scores.top[:2] == [{}, {}]  # the prompt is not trained on
    for pos in range(2, len(ids)):
        row = dist[pos - 1]
        want = set(row.topk(3).indices.tolist()) | {ids[pos]}
        assert set(scores.top[pos]) == want
        assert all(lp == pytest.approx(row[x].item(), abs=1e-5) for x, lp in scores.top[pos].items())


def test_a_teacher_listing_a_non_integer_token_id_is_one_line():
    client = DenseTeacher(TeacherConfig(base_url="http://127.0.0.1:9/v1"), 64, 3)
    try:
        assert client._listed({"7": {"logprob": -0.5}, "9": {"logprob": float("-inf")}}, 1) == {7: -0.5}
        with pytest.raises(UserError, match=r"no integer at prompt position 2: \{'abc'"):
            client._listed({"abc": {"logprob": -1.0}}, 2)
    finally:
        asyncio.run(client.close())


def test_a_teachers_lists_are_cut_to_top_k_and_checked_against_the_vocabulary():
    """A teacher listing every token (262 where top_k = 4 was asked) put them all into the batch; an id outside the
    vocabulary killed the trainer, which blamed the batch file. Now: the k likeliest plus the sampled token, and
    an out-of-vocabulary id is one line naming the teacher."""
    client = DenseTeacher(TeacherConfig(base_url="http://127.0.0.1:9/v1"), 64, 2)
    client.vocab_size = 10
    entry = {str(x): {"logprob": -float(x)} for x in range(10)}  # token x: logprob -x
    try:
        assert client._top_k(entry, 3, 7) == {0: 0.0, 1: -1.0, 7: -7.0}  # top 2 and the sampled token
        assert client._top_k(entry, 3, 1) == {0: 0.0, 1: -1.0}  # the sampled token among them: 2
        for bad in ("10", "-1"):
            with pytest.raises(UserError, match=f"listed token id {bad} at prompt position 3, outside the vocab"):
                client._top_k({**entry, bad: {"logprob": -0.1}}, 3, 1)
    finally:
        asyncio.run(client.close())


def test_a_teacher_that_never_answers_stops_the_run_in_one_line(monkeypatch):
    """A teacher that accepts scoring requests and never answers hung the run silently (1200 s x 5 tries); now two
    requests in a row past `teacher.timeout` are one line naming the teacher's URL."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held = []
    threading.Thread(target=lambda: [held.append(listener.accept()) for _ in range(16)], daemon=True).start()
    monkeypatch.setattr(teacher_mod, "BACKOFF_S", 0.0)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
    client = TeacherClient(TeacherConfig(base_url=url, timeout=0.3), 64)
    client.model = "teacher"
    sample = TokenSample(list(range(5, 12)), [False] * 4 + [True] * 3, [-1.0] * 7)

    async def go():
        try:
            return await client.score(sample)
        finally:
            await client.close()

    try:
        with pytest.raises(UserError, match=rf"teacher server at {url[:-3]} did not answer POST /v1/completions within "
                           r"0.3 s, 2 time\(s\) in a row: it hangs"):  # fmt: skip
            asyncio.run(go())
    finally:
        listener.close()


def test_a_malformed_scoring_answer_is_one_line():
    """Choices are matched to prompts by their `index`; a missing choice, a short list or no choices is a UserError."""
    client = TeacherClient(TeacherConfig(base_url="http://127.0.0.1:9/v1"), 64)
    a, b = [None, {"1": {"logprob": -1.0}}], [None, {"2": {"logprob": -2.0}}, {"3": {"logprob": -3.0}}]
    try:
        answer = {"choices": [{"index": 1, "prompt_logprobs": b}, {"index": 0, "prompt_logprobs": a}]}
        assert client._entries(answer, [[0, 1], [0, 2, 3]]) == [a, b]  # out of order: by index
        for bad in ({}, {"choices": "x"}, {"choices": [{"index": 0, "prompt_logprobs": a}]}, {"choices": [None]}):
            with pytest.raises(UserError, match=r"answered no usable prompt_logprobs \(wanted \d+, got") as e:
                client._entries(bad, [[0, 1], [0, 2, 3]])
            assert "\n" not in str(e.value)
        with pytest.raises(UserError, match=r"wanted 3, got 2"):
            client._entries({"choices": [{"index": 0, "prompt_logprobs": a}]}, [[0, 2, 3]])
    finally:
        asyncio.run(client.close())


def test_another_tokenizer_is_refused_in_one_line_naming_both_models(tiny_model_dir, tok):
    with TeacherServer(tiny_model_dir, name="big-teacher", vocab_shift=1) as srv:
        client = TeacherClient(TeacherConfig(base_url=srv.base_url), seq_len=64)
        with pytest.raises(UserError) as e:
            asyncio.run(client.connect(tok.encode(PROBE, add_special_tokens=True), "small-student"))
        message = str(e.value)
        assert "'big-teacher'" in message and "'small-student'" in message and "another tokenizer" in message
        assert "\n" not in message


def test_teacher_down_at_start_names_the_url():
    client = TeacherClient(TeacherConfig(port=9, health_timeout=0.3), seq_len=64)  # nothing listens on port 9
    with pytest.raises(UserError, match=r"teacher server at http://localhost:9 not reachable"):
        asyncio.run(client.connect([1], "student"))


@pytest.mark.parametrize("held", [None, "wrong"])
def test_a_refused_api_key_names_the_variable(tiny_model_dir, tok, monkeypatch, held):
    if held is None:
        monkeypatch.delenv("TEACHER_KEY", raising=False)
    else:
        monkeypatch.setenv("TEACHER_KEY", held)
    with TeacherServer(tiny_model_dir, api_key="sekrit") as srv:
        client = TeacherClient(TeacherConfig(base_url=srv.base_url, api_key_var="TEACHER_KEY"), seq_len=64)
        with pytest.raises(UserError, match=r"refused the API key \(401\): \$TEACHER_KEY") as e:
            asyncio.run(client.connect(tok.encode(PROBE), "student"))
        assert "\n" not in str(e.value)
        monkeypatch.setenv("TEACHER_KEY", "sekrit")
        ok = TeacherClient(TeacherConfig(base_url=srv.base_url, api_key_var="TEACHER_KEY"), seq_len=64)
        asyncio.run(ok.connect(tok.encode(PROBE, add_special_tokens=True), "student"))


def test_a_4xx_fails_loudly_with_the_servers_message(tiny_model_dir, tok, quick_retries):
    with TeacherServer(tiny_model_dir, refuse=True) as srv:
        client = TeacherClient(TeacherConfig(base_url=srv.base_url), seq_len=64)
        sample = TokenSample([1, 2, 3], [False, True, True], [0.0, -1.0, -1.0])

        async def go():
            await client.connect(tok.encode(PROBE, add_special_tokens=True), "student")
            await client.score(sample)

        with pytest.raises(UserError, match=r"refused POST /v1/completions \(400\): This model's maximum context"):
            asyncio.run(go())
        assert len(srv.requests) == 1  # not retried


# ---- the orchestrator with a teacher --------------------------------------------------------------------------
def test_distillation_steps_write_teacher_advantages_and_metrics(tmp_path, tiny_model_dir, tok):
    """Every group has equal rewards and difficulty filtering is on: distillation still trains on all of them."""
    with TeacherServer(tiny_model_dir) as srv:
        cfg = _config(
            tmp_path,
            srv.base_url,
            max_steps=2,
            max_async_level=2,
            buffer={"online_difficulty_filtering": True},
        )
        runner = FakeRunner(reward_fn=lambda *a: 1.0, turns=2)  # all solved: filtered without a teacher
        orch = _orchestrator(cfg, runner, StudentServer(tok), teacher=_teacher(cfg))
        asyncio.run(orch.run())
    records = _records(tmp_path)
    assert [r["groups/filtered"] for r in records] == [0.0, 0.0] and all(r["batch/samples"] == 8 for r in records)
    kls, lps, checked = [], [], 0
    for step in range(2):
        for mb in read_batch(RunLayout(tmp_path), step, 0):
            mb = mb.expanded()
            starts = (mb.position_ids == 0).nonzero().flatten().tolist() + [len(mb.input_ids)]
            for a, b in zip(starts, starts[1:]):
                ids, mask = mb.input_ids[a:b].tolist(), mb.loss_mask[a:b]
                adv, sampler = mb.advantages[a:b], mb.inference_logprobs[a:b]
                if not mask.any():
                    continue
                teacher = torch.tensor(srv.logprobs(ids))
                assert torch.allclose(adv[mask], (teacher - sampler)[mask], atol=1e-5)  # reward weight 0
                assert (adv[~mask] == 0).all()
                kls += (sampler - teacher)[mask].tolist()
                lps += teacher[mask].tolist()
                checked += 1
        assert abs(records[step]["distill/teacher_kl"]) > 0 and records[step]["time/teacher_s"] >= 0
    assert checked == 16 and records[0]["batch/effective_rollouts"] == 8
    both = [(r["distill/teacher_kl"], r["distill/teacher_lp"]) for r in records]
    assert sum(k for k, _ in both) / 2 == pytest.approx(sum(kls) / len(kls), rel=1e-4)
    assert sum(lp for _, lp in both) / 2 == pytest.approx(sum(lps) / len(lps), rel=1e-4)


def test_forward_kl_steps_write_the_teachers_targets_and_no_distillation_advantage(tmp_path, tiny_model_dir, tok):
    import math

    with TeacherServer(tiny_model_dir) as srv:
        cfg = _config(tmp_path, srv.base_url, max_steps=1, distill={"kind": "forward_kl", "top_k": 2, "weight": 0.5})
        teacher = teacher_mod.teacher_client(cfg.teacher, cfg.seq_len, cfg.distill, cfg.client, "student")
        orch = _orchestrator(cfg, FakeRunner(turns=2), StudentServer(tok), teacher=teacher)
        asyncio.run(orch.run())
        checked = 0
        for mb in read_batch(RunLayout(tmp_path), 0, 0):
            mb = mb.expanded()
            assert not mb.advantages.any()  # reward weight 0: the teacher's signal is all in the targets
            starts = (mb.position_ids == 0).nonzero().flatten().tolist() + [len(mb.input_ids)]
            for a, b in zip(starts, starts[1:]):
                ids, mask = mb.input_ids[a:b].tolist(), mb.loss_mask[a:b]
                mass = mb.teacher_targets[a:b]
                assert not mass[~mask].any()
                dist = srv.distributions(ids)
                for t in mask.nonzero().flatten().tolist():
                    listed = set(dist[t - 1].topk(2).indices.tolist()) | {ids[t]}
                    z = sum(math.exp(dist[t - 1][x].item()) for x in listed)
                    got = {int(i): float(w) for i, w in zip(mb.teacher_ids[a + t], mass[t]) if w > 0}
                    want = {x: 0.5 * math.exp(dist[t - 1][x].item()) / z for x in listed}
                    assert got == pytest.approx(want, abs=1e-5)
                    checked += 1
    assert checked > 0 and _records(tmp_path)[0]["distill/teacher_kl"] != 0


def test_an_asyncrl_teacher_ships_only_the_trained_positions(tiny_model_dir, tok):
    """Against asyncrl's server the client asks for prompt logprobs from the first loss token on
    (`logprob_start_len`); against one that lists every position (vLLM) it reads the same positions: equal scores."""
    sample = TokenSample(list(range(5, 17)), [False] * 9 + [True] * 3, [-1.0] * 12)
    got = {}
    for owner in ("asyncrl", None):
        with TeacherServer(tiny_model_dir, owned_by=owner) as srv:
            client = DenseTeacher(TeacherConfig(base_url=srv.base_url), seq_len=64, top_k=4)

            async def go(client=client):
                try:
                    await client.connect(tok.encode(PROBE, add_special_tokens=True), "student")
                    return await client.score(sample)
                finally:
                    await client.close()

            got[owner] = asyncio.run(go())
            scored = [b for b in srv.bodies if b.get("prompt") == [sample.input_ids]]
            assert [b.get("logprob_start_len") for b in scored] == [9 if owner else None]
            want = srv.logprobs(sample.input_ids)
    trimmed, full = got["asyncrl"], got[None]
    assert trimmed.logprobs == full.logprobs and trimmed.top == full.top
    assert (
        trimmed.logprobs[:9] == [0.0] * 9 and trimmed.top[:9] == [{}] * 9
    )  # the prompt: never trained on, not shipped
    assert trimmed.logprobs[9:] == pytest.approx(want[9:], abs=1e-5) and all(len(t) >= 4 for t in trimmed.top[9:])


def test_groups_are_scored_while_others_still_generate(tiny_model_dir):
    """Scoring starts as each group finishes, not after the step's last rollout."""
    finished: list[float] = []
    started: list[float] = []
    runner = FakeRunner(delay=0.15, seed=1)

    async def run_group(slot, inputs, args):
        out = await runner(slot, inputs, args)
        finished.append(time.monotonic())
        return out

    async def scorer(group):
        started.append(time.monotonic())
        await asyncio.sleep(0.05)
        return [TeacherScores([0.0] * len(s)) for s in group.samples]

    collector = GroupCollector(
        fake_mixture(), run_group, TrajectoryConverter(), 4, BufferConfig(), AdvantageConfig(), 8, scorer=scorer
    )

    async def collect_and_score():
        got = await collector.collect(0, 0, 1, problems=4, in_flight=4, args={})
        assert all(
            s.teacher is None
            for g in got.groups
            for s in g.samples
            # collect returns with the rollouts: the caller may generate on meanwhile
        )
        await collector.await_scores(got)
        return got

    got = asyncio.run(collect_and_score())
    assert len(got.groups) == 4 and all(s.teacher is not None for g in got.groups for s in g.samples)
    assert len(started) == 4
    assert min(started) < max(finished)  # the first group's scoring overlapped the others' generation
    assert got.teacher_seconds < 0.15  # the step waited only for the last group's scoring


def test_the_next_step_generates_while_a_step_is_scored(tmp_path, tiny_model_dir, tok):
    """A slow teacher: step n+1's rollouts start before step n's batch is written; batches stay whole and in order."""
    starts: list[float] = []
    runner = FakeRunner(delay=0.05)

    async def run_group(slot, inputs, args):
        starts.append(time.monotonic())
        return await runner(slot, inputs, args)

    written: dict[int, float] = {}
    with TeacherServer(tiny_model_dir) as srv:
        cfg = _config(tmp_path, srv.base_url, max_steps=3, max_async_level=2)
        orch = _orchestrator(cfg, run_group, StudentServer(tok), teacher=_teacher(cfg))
        score, finish = orch.collector.scorer, orch._finish

        async def slow_score(group):
            await asyncio.sleep(0.4)
            return await score(group)

        async def timed_finish(gen):
            record = await finish(gen)
            written[gen.step] = time.monotonic()
            return record

        orch.collector.scorer, orch._finish = slow_score, timed_finish
        asyncio.run(orch.run())
    assert orch.overlaps_scoring and orch.problems == 2 and len(starts) == 6  # 2 groups a step, none wasted
    assert starts[2] < written[0] and starts[4] < written[1]  # steps 1 and 2 generated while the last was scored
    assert written[0] < written[1] < written[2]
    assert len(srv.bodies) == 6 and all(len(b["prompt"]) == 4 for b in srv.bodies)  # a request per group
    assert [r["step"] for r in _records(tmp_path)] == [0, 1, 2]
    for step in range(3):
        assert len(read_batch(RunLayout(tmp_path), step, 0)) >= 1  # every batch whole
    orch.teacher.student = orch.teacher  # a baseline on the student's server: its weights must hold still
    assert not orch.overlaps_scoring
    orch.teacher.student, orch.teacher.root = None, orch.server.root  # the teacher is the student's own server
    assert not orch.overlaps_scoring


def test_teacher_dying_mid_run_is_one_clear_error(tmp_path, tiny_model_dir, tok, quick_retries):
    with TeacherServer(tiny_model_dir, die_after=2) as srv:  # a request per group: step 0's 2 groups
        cfg = _config(tmp_path, srv.base_url, max_steps=4, max_async_level=2)
        # rollouts that take a while: step 0's scoring (which overlaps step 1's generation) is done first
        orch = _orchestrator(cfg, FakeRunner(delay=0.3), StudentServer(tok), teacher=_teacher(cfg))
        with pytest.raises(UserError) as e:
            asyncio.run(orch.run())
    message = str(e.value)
    assert f"teacher server at {srv.url} stopped answering POST /v1/completions" in message
    assert "HTTP 503: engine is not running" in message and "\n" not in message
    assert len(_records(tmp_path)) == 1  # step 0's 8 samples were scored; step 1 was not written


def test_a_resumed_orchestrator_checks_the_teacher_again(tmp_path, tiny_model_dir, tok):
    with TeacherServer(tiny_model_dir) as srv:
        cfg = _config(tmp_path, srv.base_url, max_steps=2, max_async_level=2, ckpt=CkptConfig(interval=1))
        asyncio.run(_orchestrator(cfg, FakeRunner(), StudentServer(tok), teacher=_teacher(cfg)).run())
    with TeacherServer(tiny_model_dir, vocab_shift=3) as other:  # the teacher changed between the runs
        resume = CkptConfig(interval=1, resume_step=2)
        cfg2 = _config(tmp_path, other.base_url, max_steps=3, max_async_level=2, ckpt=resume)
        orch = _orchestrator(cfg2, FakeRunner(), StudentServer(tok), teacher=_teacher(cfg2))
        with pytest.raises(UserError, match="another tokenizer"):
            asyncio.run(orch.run())
        assert other.requests == []  # refused before any scoring
