"""orchestrator.envs.v1: which packages are v1 environments, what bad args say, how a trace's branch becomes
training tokens (the prompt before the first sampled token, `sampled_mask` as the completion mask)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from asyncrl.config.orchestrator import AdvantageConfig, BufferConfig, EnvConfig
from asyncrl.core.errors import UserError
from asyncrl.orchestrator.envs.loading import load_env
from asyncrl.orchestrator.envs.mixture import EnvMixture, example_id, group_inputs
from asyncrl.orchestrator.envs.v1 import (
    MAX_TASKS,
    branch_turn,
    episode_outputs,
    error_line,
    is_v1_module,
    load_v1_env,
    sampling_config,
)
from asyncrl.orchestrator.filtering import Group, judge_group
from asyncrl.orchestrator.samples import TrajectoryConverter

pytest.importorskip("verifiers.v1")
V1_ENVS = Path(__file__).resolve().parents[2] / "integration" / "v1_envs"


@pytest.fixture(autouse=True)
def v1_envs_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(V1_ENVS))


def test_a_package_exporting_a_v1_taskset_is_v1_and_a_classic_one_is_not(tmp_path, monkeypatch):
    assert is_v1_module("reverse_v1") and is_v1_module("reverse_text")
    (tmp_path / "classic_style.py").write_text("def load_environment(**kwargs):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert not is_v1_module("classic_style")


def test_a_classic_environment_under_verifiers_0_4_says_how_to_go_on(tmp_path, monkeypatch):
    """verifiers >= 0.4 has no classic loader: a classic package is named, with the two ways forward."""
    import verifiers

    (tmp_path / "classic_style.py").write_text("def load_environment(**kwargs):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    if hasattr(verifiers, "load_environment"):
        pytest.skip("verifiers < 0.4 loads classic environments (tests/classic covers them)")
    with pytest.raises(UserError, match="not a verifiers v1 environment") as e:
        load_env(EnvConfig(id="classic-style"))
    assert "verifiers<0.4" in str(e.value) and "\n" not in str(e.value)


def test_v1_tasks_are_the_mixtures_rows_with_their_ids():
    slot = EnvMixture.load([EnvConfig(id="reverse-v1")], seq_len=None).slots[0]
    assert len(slot.rows) == 8 and [example_id(t) for t in slot.rows] == list(range(8))
    task = slot.rows[3]
    assert group_inputs(task, 2) == [task, task]  # a task is run n times, not copied as a dict row


@pytest.mark.parametrize(
    "args, said",
    [
        ({"nope": 1}, "taskset.nope: Extra inputs are not permitted"),
        ({"agent": {"runtime": {"type": "nonsense"}}}, "agent.runtime"),
    ],
)
def test_bad_args_are_one_line_errors_naming_the_field(args, said):
    with pytest.raises(UserError, match="rejects args") as e:
        load_v1_env("reverse_v1", "reverse-v1", args)
    assert said in str(e.value) and "\n" not in str(e.value)


def test_sampling_flattens_extra_body_and_drops_n():
    cfg = sampling_config({"n": 1, "temperature": 0.7, "max_tokens": 9, "extra_body": {"top_k": -1, "min_p": 0.0}})
    assert cfg.model_dump(exclude_none=True) == {"temperature": 0.7, "max_tokens": 9, "top_k": -1, "min_p": 0.0}


AGENT = SimpleNamespace(name="agent", trainable=True)


def node(role: str, content: str) -> SimpleNamespace:
    return SimpleNamespace(message=SimpleNamespace(role=role, content=content))


def test_a_branch_is_one_turn_with_env_tokens_masked_and_the_engines_logprobs():
    branch = SimpleNamespace(
        token_ids=[1, 2, 3, 4, 5, 6, 7],
        sampled_mask=[False, False, True, True, False, True, True],  # 5: an env token between two turns
        logprobs=[0.0, 0.0, -0.1, -0.2, 0.0, -0.3, -0.4],
        nodes=[node("user", "reverse: abcd"), node("assistant", "dc"), node("user", "more"), node("assistant", "ba")],
        tools=[SimpleNamespace(name="t", description="d", parameters={"type": "object"})],
    )
    turn = branch_turn(branch)["tokens"]
    assert turn == {
        "prompt_ids": [1, 2],
        "completion_ids": [3, 4, 5, 6, 7],
        "completion_mask": [1, 1, 0, 1, 1],
        "completion_logprobs": [-0.1, -0.2, 0.0, -0.3, -0.4],
    }
    trace = SimpleNamespace(
        branches=[branch], reward=0.5, rewards={"exact": SimpleNamespace(score=0.5)}, metrics={"length": 4.0},
        num_turns=2, is_truncated=False, has_error=False, last_error=None, assistant_messages=[], agent=AGENT,
    )  # fmt: skip
    task = SimpleNamespace(data=SimpleNamespace(idx=3, prompt="reverse: abcd", system_prompt=None))
    (out,) = episode_outputs(task, SimpleNamespace(traces=[trace], errors=[]))
    assert out["metrics"] == {"exact": 0.5, "length": 4.0, "num_turns": 2.0}  # rewards, metrics, turns
    # the conversation as a classic output: the task's prompt, then everything after it; tools in OpenAI form
    assert [m.content for m in out["prompt"]] == ["reverse: abcd"]
    assert [m.content for m in out["completion"]] == ["dc", "more", "ba"]
    assert out["tool_defs"] == [
        {"type": "function", "function": {"name": "t", "description": "d", "parameters": {"type": "object"}}}
    ]
    rollout = TrajectoryConverter().convert(out, "r")
    assert rollout.ok and rollout.reward == 0.5 and rollout.example_id == 3
    (sample,) = rollout.samples
    assert sample.input_ids == branch.token_ids and sample.loss_mask == branch.sampled_mask
    assert sample.logprobs == branch.logprobs


def test_a_failed_episode_is_a_rollout_error_not_an_exception():
    task = SimpleNamespace(data=SimpleNamespace(idx=1, prompt="p"))
    (out,) = episode_outputs(task, RuntimeError("server went away"))
    rollout = TrajectoryConverter().convert(out, "r")
    assert not rollout.ok and rollout.error == "RuntimeError: server went away"


def test_a_failed_programs_error_is_its_last_line():
    """A harness error carries the program's traceback; the rollout's error is its cause, one line."""
    error = SimpleNamespace(type="HarnessError", message="exited 1: Traceback ...\n  File x\nValueError: bad")
    assert error_line(error) == "HarnessError: ValueError: bad"


def test_a_seat_that_never_acted_is_left_out_and_an_episode_without_any_call_is_one_error():
    task = SimpleNamespace(data=SimpleNamespace(idx=2, prompt="p", system_prompt=None))
    branch = SimpleNamespace(token_ids=[1, 2], sampled_mask=[False, True], logprobs=[0.0, -0.5], nodes=[], tools=[])
    played = SimpleNamespace(
        branches=[branch], reward=-1.0, rewards={}, metrics={}, num_turns=1, is_truncated=False, has_error=False,
        last_error=None, assistant_messages=[], agent=AGENT,
    )  # fmt: skip
    idle = SimpleNamespace(branches=[], reward=1.0, has_error=False, agent=AGENT)
    outs = episode_outputs(task, SimpleNamespace(traces=[idle, played], errors=[]))
    assert [o["reward"] for o in outs] == [-1.0]
    (out,) = episode_outputs(task, SimpleNamespace(traces=[idle], errors=[]))
    assert out["error"] == "no agent of the episode made a model call"


def _trace(agent: str, reward: float, trainable: bool = True) -> SimpleNamespace:
    branch = SimpleNamespace(token_ids=[1, 2], sampled_mask=[False, True], logprobs=[0.0, -0.5], nodes=[], tools=[])
    return SimpleNamespace(
        branches=[branch], reward=reward, rewards={}, metrics={}, num_turns=1, is_truncated=False, has_error=False,
        last_error=None, assistant_messages=[], agent=SimpleNamespace(name=agent, trainable=trainable),
    )  # fmt: skip


def test_untrainable_agents_are_not_trained_on():
    """verifiers marks a simulated user or a judge `trainable=False`: training leaves its trace out; eval
    scores the trainable agents, or every agent when none is trainable (verifiers' own rule)."""
    task = SimpleNamespace(data=SimpleNamespace(idx=2, prompt="p", system_prompt=None))
    episode = SimpleNamespace(traces=[_trace("user", 0.0, trainable=False), _trace("solver", 1.0)], errors=[])
    assert [(o["agent"], o["reward"]) for o in episode_outputs(task, episode)] == [("solver", 1.0)]
    assert [o["agent"] for o in episode_outputs(task, episode, train=False)] == ["solver"]
    users = SimpleNamespace(traces=[_trace("user", 0.0, trainable=False)], errors=[])
    (out,) = episode_outputs(task, users)
    assert out["error"] == "no agent of the episode is trainable"
    assert [o["agent"] for o in episode_outputs(task, users, train=False)] == ["user"]


def test_each_agent_of_a_group_has_its_own_baseline():
    """Two seats of one game: each trace's advantage is against the same seat's mean over the group."""
    converter = TrajectoryConverter()
    task = SimpleNamespace(data=SimpleNamespace(idx=0, prompt="p", system_prompt=None))
    outs = [
        o
        for first, second in [(1.0, -1.0), (0.0, 0.0), (1.0, -1.0), (-1.0, 1.0)]
        for o in episode_outputs(
            task, SimpleNamespace(traces=[_trace("first", first), _trace("second", second)], errors=[])
        )
    ]
    group = Group(env="game", example_id=0, policy_step=0, rollouts=[converter.convert(o, "game") for o in outs])
    judge_group(group, BufferConfig(), AdvantageConfig())
    by_seat = {a: [r.advantage for r in group.rollouts if r.agent == a] for a in ("first", "second")}
    assert by_seat["first"] == pytest.approx([0.75, -0.25, 0.75, -1.25])  # first's mean: 0.25
    assert by_seat["second"] == pytest.approx([-0.75, 0.25, -0.75, 1.25])  # second's mean: -0.25


def test_a_taskset_without_end_is_taken_in_order_each_task_once_and_resumes():
    mixture = EnvMixture.load([EnvConfig(id="counting-v1")], seq_len=None, seed=3)
    slot = mixture.slots[0]
    assert len(slot.rows) == MAX_TASKS and slot.stream is not None
    drawn = [example_id(mixture.draw()[1]) for _ in range(MAX_TASKS + 5)]
    assert drawn == list(range(MAX_TASKS + 5))  # past the first MAX_TASKS: new tasks, not a second epoch
    again = EnvMixture.load([EnvConfig(id="counting-v1")], seq_len=None, seed=3)
    again.load_state(json.loads(json.dumps(mixture.state())))
    assert [example_id(again.draw()[1]) for _ in range(3)] == [MAX_TASKS + 5, MAX_TASKS + 6, MAX_TASKS + 7]
    evals = EnvMixture.load([EnvConfig(id="counting-v1")], seq_len=None, eval_split=True).slots[0]
    assert evals.stream is None and len(evals.rows) == MAX_TASKS  # held-out evals take the first tasks


def test_a_curriculum_needs_a_finite_taskset():
    with pytest.raises(UserError, match="generates tasks without end: a curriculum needs a finite taskset"):
        EnvMixture.load([EnvConfig(id="counting-v1", curriculum={})], seq_len=None)
    slot = EnvMixture.load([EnvConfig(id="reverse-v1", curriculum={})], seq_len=None).slots[0]
    assert slot.curriculum is not None and slot.curriculum.ids == list(range(8))
