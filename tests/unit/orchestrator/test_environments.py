"""The verifiers v1 environments in environments/: data generation, rewards, SFT data, loading, rollouts.

Each environment is a v1 taskset loaded the way asyncrl loads it (`envs.load_env`). Rewards are checked
by hand, through the pure scoring functions and through the Task's own @vf.reward/@vf.metric methods on a
stand-in trace. Rollouts are real v1 episodes (`orchestrator.envs.v1.v1_run_group`, verifiers' eval client,
asyncrl's in-process chat harness, the calculator's MCP server) against a real local HTTP server that plays
the model with scripted chat-completions replies (scripted_server.py) and records what it was sent.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import verifiers.v1 as vf
from scripted_server import ScriptedServer

ENV_DIR = Path(__file__).resolve().parents[3] / "environments"
for _name in ("reverse_text", "tool_calc", "echo_twice", "sort_letters"):
    # Editable installs make these importable; a fresh checkout without them still tests.
    if importlib.util.find_spec(_name) is None:
        sys.path.insert(0, str(ENV_DIR / _name))

import echo_twice  # noqa: E402
import reverse_text  # noqa: E402
import sort_letters  # noqa: E402
import tool_calc  # noqa: E402
from tool_calc.calculator import Calculator  # noqa: E402

from asyncrl.config import loader  # noqa: E402
from asyncrl.config.orchestrator import ClientConfig, EnvConfig  # noqa: E402
from asyncrl.core.errors import UserError  # noqa: E402
from asyncrl.orchestrator.envs.loading import load_env  # noqa: E402
from asyncrl.orchestrator.envs.v1 import is_v1_env, v1_run_group, v1_tasks  # noqa: E402

KEY_VAR = "ASYNCRL_TEST_SCRIPTED_KEY"

# ---------------------------------------------------------------- helpers


def _env(env_id: str, eval_split: bool = False, **args: Any) -> Any:
    return load_env(EnvConfig(id=env_id, args=args), eval_split)


def _tasks(env_id: str, **args: Any) -> list[Any]:
    return v1_tasks(_env(env_id, **args), env_id)


def _reply(content: str | None) -> vf.AssistantMessage:
    return vf.AssistantMessage(content=content)


def _call(expression: str, call_id: str = "c0") -> vf.AssistantMessage:
    """A model turn that calls the calculator (and says nothing)."""
    args = json.dumps({"expression": expression})
    return vf.AssistantMessage(content=None, tool_calls=[vf.ToolCall(id=call_id, name="calculate", arguments=args)])


def _trace(*replies: str | vf.AssistantMessage) -> SimpleNamespace:
    """A stand-in for a finished vf.Trace whose model turns are `replies` (what the tasks' scores read)."""
    msgs = [r if isinstance(r, vf.AssistantMessage) else _reply(r) for r in replies]
    last = (msgs[-1].content or "").strip() if msgs else ""
    return SimpleNamespace(assistant_messages=msgs, num_turns=len(msgs), last_reply=last)


def _score(method: Any, *replies: str | vf.AssistantMessage) -> Any:
    """A task's async @vf.reward/@vf.metric/@vf.stop method on a stand-in trace."""
    return asyncio.run(method(_trace(*replies)))


@pytest.fixture
def rollouts(monkeypatch):
    """`rollouts(env, tasks, replies)`: run one episode per task against a ScriptedServer answering with
    `replies` (a list, or a function of the request); returns (the rollout outputs, the server)."""
    monkeypatch.setenv(KEY_VAR, "scripted-key")

    def run(env: Any, tasks: list[Any], replies: Any, **sampling: Any) -> tuple[list[dict], ScriptedServer]:
        with ScriptedServer(replies) as server:
            client = ClientConfig(base_url=server.url, api_key_var=KEY_VAR)
            run_group = v1_run_group(client, "scripted", "scripted", train=False)
            outputs = asyncio.run(run_group(SimpleNamespace(env=env), tasks, {"n": 1, **sampling}))
        assert len(outputs) == len(tasks)
        for out in outputs:
            assert "error" not in out, out
        return outputs, server

    return run


def _said(message: dict) -> tuple[str, str | None]:
    return message["role"], message.get("content")


def _expression(task: Any) -> str:
    return task.data.prompt.removeprefix("What is ").removesuffix("?")


# ---------------------------------------------------------------- reverse-text


def test_reverse_text_tasks_deterministic_sized_and_split():
    args = {"num_train_examples": 50, "num_eval_examples": 20}
    a, b = _tasks("reverse-text", seed=3, **args), _tasks("reverse-text", seed=3, **args)
    c = _tasks("reverse-text", seed=4, **args)
    held_out = _tasks("reverse-text", seed=3, split="eval", **args)
    assert len(a) == 50 and len(held_out) == 20
    assert [t.data.idx for t in a] == list(range(50))
    assert [t.data.prompt for t in a] == [t.data.prompt for t in b]
    assert [t.data.answer for t in a] != [t.data.answer for t in c]
    assert [t.data.answer for t in a[:20]] != [t.data.answer for t in held_out]
    for task in [*a, *held_out]:
        text = task.data.prompt.removeprefix("Reverse the text: ")
        assert task.data.prompt == f"Reverse the text: {text}" and task.data.system_prompt is None
        assert 5 <= len(text) <= 8 and text.isalpha() and text.islower()
        assert task.data.answer == text[::-1]
    assert [t.data.answer[::-1] for t in a[:20]] == reverse_text.random_strings(20, 3, "train", 5, 8)


def test_reverse_text_eval_split_is_the_held_out_stream():
    args = {"num_train_examples": 10, "num_eval_examples": 4, "seed": 1}
    evals = v1_tasks(_env("reverse-text", eval_split=True, **args), "reverse-text")
    assert [t.data.prompt for t in evals] == [t.data.prompt for t in _tasks("reverse-text", split="eval", **args)]
    assert len(evals) == 4
    # an explicit split wins over the held-out default
    trains = v1_tasks(_env("reverse-text", eval_split=True, split="train", **args), "reverse-text")
    assert len(trains) == 10
    with pytest.raises(UserError, match="'reverse-text' .*has no tasks"):
        v1_tasks(_env("reverse-text", eval_split=True, num_eval_examples=0), "reverse-text")


def test_reverse_text_lengths_and_user_template():
    tasks = _tasks("reverse-text", num_train_examples=30, min_len=2, max_len=3)
    assert {len(t.data.answer) for t in tasks} == {2, 3}
    bare = _tasks("reverse-text", num_train_examples=5, user_template="{text}", reward="exact")
    assert all(t.data.prompt == t.data.answer[::-1] for t in bare)
    assert all(t.config.reward == "exact" for t in bare)
    rows = reverse_text.sft_examples(3, system_prompt="S", user_template="{text}")
    assert rows[0]["prompt"][1]["content"] == rows[0]["completion"][0]["content"][::-1]


def test_reverse_text_rewards_hand_checked():
    lcs = reverse_text.lcs_reward
    assert lcs("olleh", "olleh") == 1.0
    assert lcs("  olleh\n", "olleh") == 1.0  # whitespace is stripped
    assert lcs("", "olleh") == 0.0
    assert lcs("xyz", "olleh") == 0.0
    assert lcs("ollxx", "olleh") == pytest.approx(2 * 3 / 10)  # 3 of 5 characters match in order
    assert lcs("hello", "olleh") == pytest.approx(2 * 2 / 10)  # unreversed: only "ll" lines up
    assert reverse_text.exact_match(" olleh ", "olleh") == 1.0
    assert reverse_text.exact_match("olle", "olleh") == 0.0


def test_reverse_text_task_scores_a_trace():
    (task,) = _tasks("reverse-text", num_train_examples=1)
    answer = task.data.answer
    assert _score(task.reward, answer) == {"lcs_reward": 1.0}
    assert _score(task.scores, answer) == {"lcs_reward": 1.0, "exact_match": 1.0}
    partial = answer[:-2] + "??"
    expected = reverse_text.lcs_reward(partial, answer)
    assert 0.0 < expected < 1.0
    assert _score(task.reward, partial) == {"lcs_reward": pytest.approx(expected)}
    assert _score(task.scores, "") == {"lcs_reward": 0.0, "exact_match": 0.0}
    assert _score(task.reward) == {"lcs_reward": 0.0}  # no reply at all
    assert _score(task.single_turn, answer) is True and _score(task.single_turn) is False

    (exact,) = _tasks("reverse-text", num_train_examples=1, reward="exact")
    assert _score(exact.reward, f" {answer}\n") == {"exact_match": 1.0}
    assert _score(exact.reward, partial) == {"exact_match": 0.0}
    assert _score(exact.scores, partial)["lcs_reward"] == pytest.approx(expected)  # still logged


def test_reverse_text_rollouts_through_a_scripted_server(rollouts):
    env = _env("reverse-text", num_train_examples=3, seed=1)
    tasks = v1_tasks(env, "reverse-text")
    right, partial, empty = (t.data.answer for t in tasks)
    by_prompt = {tasks[0].data.prompt: right, tasks[1].data.prompt: partial[:-2] + "??", tasks[2].data.prompt: ""}
    outs, server = rollouts(
        env, tasks, lambda body: {"content": by_prompt[body["messages"][-1]["content"]]}, temperature=0.5, max_tokens=9
    )
    assert [o["example_id"] for o in outs] == [0, 1, 2]
    assert outs[0]["reward"] == 1.0 and outs[0]["metrics"]["exact_match"] == 1.0
    assert outs[0]["metrics"]["num_turns"] == 1.0 and outs[0]["is_truncated"] is False
    assert outs[1]["reward"] == pytest.approx(reverse_text.lcs_reward(partial[:-2] + "??", partial))
    assert 0.0 < outs[1]["reward"] < 1.0 and outs[1]["metrics"]["exact_match"] == 0.0
    assert outs[2]["reward"] == 0.0
    assert set(outs[0]["metrics"]) == {"lcs_reward", "exact_match", "num_turns"}
    assert len(server.requests) == 3  # one model call each: the task stops after the first reply
    for request in server.requests:
        # exactly the SFT prompt format, no tools; the run's sampling args and the key from api_key_var
        text = request["messages"][-1]["content"].removeprefix("Reverse the text: ")
        assert request["messages"] == reverse_text.make_prompt(text)
        assert "tools" not in request
        assert request["model"] == "scripted" and request["temperature"] == 0.5 and request["max_tokens"] == 9
    assert {h["authorization"] for h in server.headers} == {"Bearer scripted-key"}


def test_reverse_text_system_prompt_file_matches_sft_format(rollouts, tmp_path):
    """v1's system prompt is the taskset's `system_prompt` file; the env then sends what SFT rows hold."""
    (tmp_path / "system.txt").write_text("S")
    env = _env("reverse-text", num_train_examples=1, seed=7, system_prompt=str(tmp_path / "system.txt"))
    (task,) = v1_tasks(env, "reverse-text")
    assert task.data.system_prompt == "S"
    _, server = rollouts(env, [task], [{"content": task.data.answer}])
    (request,) = server.requests
    assert request["messages"] == reverse_text.make_prompt(task.data.answer[::-1], "S")
    row = reverse_text.sft_examples(1, seed=7, system_prompt="S")[0]
    assert [m["role"] for m in row["prompt"]] == [m["role"] for m in request["messages"]] == ["system", "user"]


def test_reverse_text_instructions_are_the_system_prompt_text(rollouts):
    """`instructions` (text) is what `rl --bench` and the SFT data use; the request matches the SFT rows."""
    env = _env("reverse-text", num_train_examples=1, seed=7, instructions="S", user_template="{text}")
    (task,) = v1_tasks(env, "reverse-text")
    _, server = rollouts(env, [task], [{"content": task.data.answer}])
    (request,) = server.requests
    assert request["messages"] == reverse_text.make_prompt(task.data.answer[::-1], "S", "{text}")


def test_reverse_text_sft_matches_env_prompt_format():
    tasks = _tasks("reverse-text", num_train_examples=20, seed=7)
    rows = reverse_text.sft_examples(20, seed=7, system_prompt="S")
    assert rows == reverse_text.sft_examples(20, seed=7, system_prompt="S")
    assert len(rows) == 20
    for row in rows:
        (completion,) = row["completion"]
        assert completion["role"] == "assistant"
        assert row["prompt"] == reverse_text.make_prompt(completion["content"][::-1], "S")
    for task in tasks:  # the env's prompt for its (different) string comes from the same builder
        assert reverse_text.make_prompt(task.data.answer[::-1]) == [{"role": "user", "content": task.data.prompt}]
    assert [r["completion"][0]["content"] for r in rows] != [t.data.answer for t in tasks]


def test_reverse_text_sft_cli(tmp_path, capsys):
    out = tmp_path / "sub" / "sft.jsonl"
    cmd = [sys.executable, "-m", "reverse_text", "--sft-out", str(out), "--n", "12", "--seed", "2", "--max-len", "6"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ENV_DIR / "reverse_text")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == reverse_text.sft_examples(12, seed=2, max_len=6)
    assert not list(out.parent.glob(".*tmp"))  # temp file was renamed away
    never = tmp_path / "never.jsonl"
    for bad_args, message in [
        (["--min-len", "9", "--max-len", "3"], "error: max_len (3) must be >= min_len (9)"),
        (["--n", "0"], "error: n must be >= 1, got 0"),
    ]:
        capsys.readouterr()
        assert reverse_text.main(["--sft-out", str(never), *bad_args]) == 2  # the CLI's exit status
        assert capsys.readouterr().err.strip() == message
        assert not never.exists()


def test_reverse_text_prompt_fits_tiny_context(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = reverse_text.sft_examples(200, seed=0)
    longest = max(rows, key=lambda r: len(r["completion"][0]["content"]))
    enc = tok.apply_chat_template(longest["prompt"] + longest["completion"], tokenize=True, return_dict=True)
    # Byte-level tokenizer: 8 letters each way + ChatML framing is ~55 tokens, well inside 128.
    assert len(enc["input_ids"]) <= 64, len(enc["input_ids"])


# ---------------------------------------------------------------- tool-calc


@pytest.mark.parametrize(
    "expr, value",
    [
        ("37 * 12 + 5", 449),
        ("(2 + 3) * -4", -20),
        ("7 / 2", 3.5),
        ("7 // 2", 3),
        ("2 ** 10", 1024),
        ("17 % 5", 2),
        ("+1.5 - 0.5", 1.0),
        ("2 ** -1", 0.5),
    ],
)
def test_safe_eval_arithmetic(expr, value):
    assert tool_calc.safe_eval(expr) == value


@pytest.mark.parametrize(
    "expr, message",
    [
        ("__import__('os').system('true')", "unsupported syntax Call"),
        ("x + 1", "unsupported syntax Name"),
        ("(1).__class__", "unsupported syntax Attribute"),
        ("'a' * 3", "unsupported constant 'a'"),
        ("True + 1", "unsupported constant True"),
        ("[1, 2]", "unsupported syntax List"),
        ("1 if 1 else 2", "unsupported syntax IfExp"),
        ("1 < 2", "unsupported syntax Compare"),
        ("1j * 2", "unsupported constant 1j"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("9 ** 9 ** 9", "too large"),
        ("2 ** 100000", "too large"),
        ("10.0 ** 400", "too large"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 +", "cannot parse"),
        ("1" * 201, "longer than 200"),
    ],
)
def test_safe_eval_refuses(expr, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("*", r"\*")):
        tool_calc.safe_eval(expr)


def test_calculate_and_the_calculator_tool():
    assert tool_calc.calculate("37 * 12 + 5") == "449"
    assert tool_calc.calculate("6 / 3") == "2"
    assert tool_calc.calculate("1 / 3") == "0.333333333333"
    tool = Calculator(vf.ToolsetConfig())
    assert tool.calculate("37 * 12 + 5") == "449"
    # a refused expression is the tool's answer to the model, not an exception
    assert tool.calculate("__import__('os')").startswith("Error: unsupported syntax Call")
    assert tool.calculate("1 / 0") == "Error: division by zero"


def test_last_number():
    assert tool_calc.last_number("37*12 = 444, plus 5 gives 449.") == 449
    assert tool_calc.last_number("It is -12") == -12
    assert tool_calc.last_number("Total: 1,234") == 1234
    assert tool_calc.last_number("2.50") == 2.5
    assert tool_calc.last_number("no digits") is None


def test_tool_calc_tasks_and_tool_schema():
    args = {"num_train_examples": 40, "num_eval_examples": 10, "seed": 5}
    a, b = _tasks("tool-calc", **args), _tasks("tool-calc", **args)
    held_out = _tasks("tool-calc", split="eval", **args)
    assert len(a) == 40 and len(held_out) == 10
    assert [t.data.prompt for t in a] == [t.data.prompt for t in b]
    assert [t.data.prompt for t in a[:10]] != [t.data.prompt for t in held_out]
    for task in [*a, *held_out]:
        assert task.data.system_prompt == tool_calc.DEFAULT_SYSTEM_PROMPT
        expr = _expression(task)
        assert task.data.prompt == f"What is {expr}?" and task.data.expression == expr
        assert len(expr.split()) == 5  # three terms, two operators
        assert task.data.answer == tool_calc.format_number(tool_calc.safe_eval(expr))
        assert task.config.max_turns == 3 and task.config.shaping == 0.0
    assert all(t.data.system_prompt is None for t in _tasks("tool-calc", num_train_examples=3, instructions=None))
    (tool,) = tool_calc.tool_specs()
    assert tool["type"] == "function" and tool["function"]["name"] == "calculate"
    params = tool["function"]["parameters"]
    assert params["required"] == ["expression"] and params["properties"]["expression"]["type"] == "string"


def test_tool_calc_task_scores_traces():
    (task,) = _tasks("tool-calc", num_train_examples=1, seed=2)
    expr, answer = task.data.expression, task.data.answer
    wrong = str(int(answer) + 1)
    right = (_call(expr), _reply(f"{expr} = {answer}, so the answer is {answer}."))
    assert _score(task.shaped_reward, *right) == 1.0
    assert _score(task.scores, *right) == {
        "correct_answer": 1.0,
        "expression_similarity": 1.0,
        "answer_similarity": 1.0,
        "calculate_calls": 1.0,
    }
    assert _score(task.shaped_reward, f"{expr} = {wrong}") == 0.0
    assert _score(task.scores, f"{expr} = {wrong}")["calculate_calls"] == 0.0
    assert _score(task.shaped_reward, "I don't know") == 0.0
    # still calling tools: not a final answer, even with the right number in it
    unfinished = vf.AssistantMessage(content=answer, tool_calls=_call(expr).tool_calls)
    assert _score(task.shaped_reward, unfinished) == 0.0
    assert _score(task.scores, _call(expr), _call(expr), _reply(answer))["calculate_calls"] == 2.0
    assert _score(task.out_of_turns, _call(expr), _call(expr)) is False
    assert _score(task.out_of_turns, _call(expr), _call(expr), _reply(answer)) is True


def test_tool_calc_shaping_gives_partial_credit():
    (shaped_task,) = _tasks("tool-calc", num_train_examples=1, shaping=0.5)
    assert shaped_task.config.shaping == 0.5
    data = tool_calc.CalcData(idx=0, prompt="What is 37 * 12 + 5?", expression="37 * 12 + 5", answer="449")
    plain, shaped = tool_calc.CalcTask(data, tool_calc.CalcTaskConfig()), tool_calc.CalcTask(data, shaped_task.config)
    traces = {
        "right": (_call("37 * 12 + 5"), _reply("449")),
        "close": (_call("37 * 13 + 5"), _reply("486")),
        "none": (_reply("I don't know"),),
    }
    scores = {name: _score(shaped.scores, *trace) for name, trace in traces.items()}
    assert scores["right"]["expression_similarity"] == 1.0 and scores["right"]["answer_similarity"] == 1.0
    close = scores["close"]
    assert 0.5 < close["expression_similarity"] < 1.0 and 0.0 < close["answer_similarity"] < 1.0
    assert close["expression_similarity"] == pytest.approx(2 * 6 / 14)  # "37*12+5" vs "37*13+5", spaces dropped
    assert close["answer_similarity"] == pytest.approx(2 * 1 / 6)  # "486" vs "449": the "4"
    assert scores["none"]["expression_similarity"] == 0.0 and scores["none"]["answer_similarity"] == 0.0
    # without shaping the similarities are only metrics; with it they join the reward
    assert [_score(plain.shaped_reward, *t) for t in traces.values()] == [1.0, 0.0, 0.0]
    assert _score(shaped.shaped_reward, *traces["right"]) == 1.0
    assert _score(shaped.shaped_reward, *traces["none"]) == 0.0
    expected = 0.25 * (close["expression_similarity"] + close["answer_similarity"])
    assert _score(shaped.shaped_reward, *traces["close"]) == pytest.approx(expected)


def test_tool_calc_rollout_with_a_tool_call(rollouts):
    env = _env("tool-calc", num_train_examples=3, seed=1)
    task = v1_tasks(env, "tool-calc")[0]
    script = [
        {"content": None, "tool_calls": [("calculate", {"expression": _expression(task)})]},
        {"content": f"The answer is {task.data.answer}."},
    ]
    (out,), server = rollouts(env, [task], script)
    first, second = server.requests
    assert first["messages"] == [
        {"role": "system", "content": tool_calc.DEFAULT_SYSTEM_PROMPT},
        {"role": "user", "content": task.data.prompt},
    ]
    # the tools the model is offered are exactly the ones the SFT rows render with
    assert first.get("tools") == tool_calc.tool_specs()
    tool_msg = second["messages"][-1]
    assert _said(tool_msg) == ("tool", task.data.answer) and tool_msg["tool_call_id"] == "call_0"
    assert out["reward"] == 1.0
    assert out["metrics"]["calculate_calls"] == 1.0 and out["metrics"]["num_turns"] == 2.0


def test_tool_calc_rollout_refused_call_and_max_turns(rollouts):
    env = _env("tool-calc", num_train_examples=3, max_turns=2)
    bad = {"content": None, "tool_calls": [("calculate", {"expression": "__import__('os')"})]}
    (out,), server = rollouts(env, v1_tasks(env, "tool-calc")[:1], [bad, bad, bad])
    assert len(server.requests) == 2  # max_turns stops the loop
    tool_msg = server.requests[1]["messages"][-1]
    assert tool_msg["role"] == "tool"
    assert tool_msg["content"].startswith("Error: unsupported syntax Call"), tool_msg
    assert out["reward"] == 0.0 and out["metrics"]["calculate_calls"] == 2.0


def test_tool_calc_sft_rows_replay_as_rewarded_rollouts(rollouts, tiny_model_dir):
    """An SFT row is exactly a rollout the env gives reward 1, with the same prompt and `tools` the episode
    sends, and SFT trains on the model's turns (tool call, answer) only, never on the tool's reply."""
    from transformers import AutoTokenizer

    from asyncrl.trainer.sft.data import ConversationTokenizer

    rows = tool_calc.sft_examples(4, seed=3)
    assert len({r["prompt"][-1]["content"] for r in rows}) == 4
    row = rows[0]
    system, user = row["prompt"]
    call, tool_reply, answer = row["completion"]
    fn = call["tool_calls"][0]["function"]
    expr = json.loads(fn["arguments"])["expression"]
    env = _env("tool-calc", num_train_examples=1)
    data = tool_calc.CalcData(
        idx=0, prompt=user["content"], system_prompt=system["content"], expression=expr, answer=answer["content"]
    )
    task = tool_calc.CalcTask(data, v1_tasks(env, "tool-calc")[0].config)
    script = [{"content": None, "tool_calls": [(fn["name"], {"expression": expr})]}, {"content": answer["content"]}]
    (out,), server = rollouts(env, [task], script)
    first, second = server.requests
    assert first["messages"] == row["prompt"]
    assert first.get("tools") == row["tools"]
    sent_tool = second["messages"][-1]
    assert _said(sent_tool) == _said(tool_reply) and sent_tool["tool_call_id"] == tool_reply["tool_call_id"]
    assert out["reward"] == 1.0 and out["metrics"]["calculate_calls"] == 1.0

    conv = ConversationTokenizer(AutoTokenizer.from_pretrained(tiny_model_dir), ["assistant"])
    sample = conv.tokenize_row(row, 0)
    trained = conv.tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m])
    assert fn["arguments"] in trained and trained.endswith(answer["content"] + "<|im_end|>\n")
    assert "<tool_response>" not in trained and "What is" not in trained


def test_tool_calc_sft_cli(tmp_path, capsys):
    out = tmp_path / "sft.jsonl"
    cmd = [sys.executable, "-m", "tool_calc", "--sft-out", str(out), "--n", "6", "--seed", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ENV_DIR / "tool_calc")
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(line) for line in out.read_text().splitlines()] == tool_calc.sft_examples(6, seed=1)
    assert not list(tmp_path.glob(".*tmp"))
    never = tmp_path / "never.jsonl"
    capsys.readouterr()
    assert tool_calc.main(["--sft-out", str(never), "--n", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: n must be >= 1, got 0" and not never.exists()


# ---------------------------------------------------------------- echo-twice


def test_echo_twice_two_turn_rollout(rollouts):
    env = _env("echo-twice", num_train_examples=4, seed=2)
    assert type(env) is echo_twice.EchoTwiceEnv  # the taskset's own Env sends the follow-up
    tasks = v1_tasks(env, "echo-twice")[:2]
    good, sloppy = (t.data.answer for t in tasks)
    assert tasks[0].data.prompt == f"Say exactly: {good}"

    def reply(body: dict) -> dict:
        word = body["messages"][0]["content"].removeprefix("Say exactly: ")
        second_turn = len(body["messages"]) > 1
        if second_turn:
            return {"content": f" {word}\n" if word == good else "something else"}
        return {"content": word}

    (both, one), server = rollouts(env, tasks, reply)
    assert both["reward"] == 1.0 and both["metrics"]["correct_replies"] == 2.0
    assert both["metrics"]["num_turns"] == 2.0
    assert one["reward"] == 0.0 and one["metrics"]["correct_replies"] == 1.0
    assert len(server.requests) == 4
    seconds = {r["messages"][0]["content"]: r for r in server.requests if len(r["messages"]) > 1}
    for word in (good, sloppy):
        sent = [_said(m) for m in seconds[f"Say exactly: {word}"]["messages"]]
        # the same three messages as echo-twice's second-turn SFT rows
        assert sent == [("user", f"Say exactly: {word}"), ("assistant", word), ("user", "Say it again.")]


def test_echo_twice_tasks_deterministic():
    args = {"num_train_examples": 30, "num_eval_examples": 5, "seed": 9}
    a, b = _tasks("echo-twice", **args), _tasks("echo-twice", **args)
    held_out = _tasks("echo-twice", split="eval", **args)
    assert [t.data.answer for t in a] == [t.data.answer for t in b]
    assert len(a) == 30 and len(held_out) == 5
    assert [t.data.answer for t in a[:5]] != [t.data.answer for t in held_out]
    assert all(3 <= len(t.data.answer) <= 6 for t in a)
    assert all(t.data.follow_up == "Say it again." for t in a)
    custom = _tasks("echo-twice", num_train_examples=2, follow_up="Once more.", reward="similarity")
    assert [t.data.follow_up for t in custom] == ["Once more."] * 2 and custom[0].config.reward == "similarity"
    second_turn = echo_twice.sft_examples(2, seed=0)[1]["prompt"]
    assert [m["role"] for m in second_turn] == ["user", "assistant", "user"]
    assert second_turn[2]["content"] == "Say it again."


def test_echo_twice_rewards_hand_checked():
    assert echo_twice.both_correct(["cat", "cat"], "cat") == 1.0
    assert echo_twice.both_correct(["cat"], "cat") == 0.0  # one reply is not two
    assert echo_twice.both_correct(["cat", "cat", "cat"], "cat") == 0.0
    assert echo_twice.both_correct(["cat", "cut"], "cat") == 0.0
    assert echo_twice.correct_replies(["cat", "cut"], "cat") == 1.0
    assert echo_twice.similarity(["cat", "cut"], "cat") == pytest.approx((1.0 + 2 / 3) / 2)
    assert echo_twice.similarity(["cat"], "cat") == pytest.approx(0.5)  # the missing reply counts as ""
    assert echo_twice.replies(_trace(" cat\n", _reply(None))) == ["cat", ""]

    (task,) = _tasks("echo-twice", num_train_examples=1)
    word = task.data.answer
    assert _score(task.reward, word, f" {word} ") == {"both_correct": 1.0}
    assert _score(task.scores, word, "nope") == {
        "both_correct": 0.0,
        "similarity": pytest.approx(echo_twice.similarity([word, "nope"], word)),
        "correct_replies": 1.0,
    }
    (partial,) = _tasks("echo-twice", num_train_examples=1, reward="similarity")
    assert _score(partial.reward, word, word[:-1]) == {
        "similarity": pytest.approx(echo_twice.similarity([word, word[:-1]], word))
    }


# ---------------------------------------------------------------- sort-letters


def _sort_text(prompt: str) -> str:
    assert prompt.startswith("Sort the letters: "), prompt
    return prompt.removeprefix("Sort the letters: ")


def test_sort_letters_tasks_deterministic_sized_and_split():
    args = {"num_train_examples": 50, "num_eval_examples": 20}
    a, b = _tasks("sort-letters", seed=3, **args), _tasks("sort-letters", seed=3, **args)
    c = _tasks("sort-letters", seed=4, **args)
    held_out = _tasks("sort-letters", seed=3, split="eval", **args)
    assert len(a) == 50 and len(held_out) == 20
    assert [t.data.prompt for t in a] == [t.data.prompt for t in b]
    assert [t.data.prompt for t in a] != [t.data.prompt for t in c]
    for task in [*a, *held_out]:
        text = _sort_text(task.data.prompt)
        assert 5 <= len(text) <= 8 and text.isalpha() and text.islower()
        assert task.data.answer == "".join(sorted(text))
    # train, eval and sft are independent streams: different strings for the same seed
    train = [_sort_text(t.data.prompt) for t in a[:20]]
    held = [_sort_text(t.data.prompt) for t in held_out]
    sft = [_sort_text(r["prompt"][-1]["content"]) for r in sort_letters.sft_examples(20, seed=3)]
    assert train != held and train != sft and held != sft
    assert train == sort_letters.random_strings(20, 3, "train", 5, 8)
    assert held == sort_letters.random_strings(20, 3, "eval", 5, 8)


def test_sort_letters_lengths_and_eval_split():
    tasks = _tasks("sort-letters", num_train_examples=30, min_len=2, max_len=3)
    assert {len(t.data.answer) for t in tasks} == {2, 3}
    assert all(list(t.data.answer) == sorted(t.data.answer) for t in tasks)
    evals = v1_tasks(_env("sort-letters", eval_split=True, num_eval_examples=6), "sort-letters")
    assert [t.data.prompt for t in evals] == [t.data.prompt for t in _tasks("sort-letters", split="eval")][:6]
    with pytest.raises(UserError, match="has no tasks"):
        v1_tasks(_env("sort-letters", eval_split=True, num_eval_examples=0), "sort-letters")


def test_sort_letters_rewards_hand_checked():
    sim = sort_letters.similarity
    assert sort_letters.sorted_letters("hello") == "ehllo"
    assert sim("ehllo", "ehllo") == 1.0
    assert sim("  ehllo\n", "ehllo") == 1.0  # whitespace is stripped
    assert sim("", "ehllo") == 0.0
    assert sim("xyz", "ehllo") == 0.0
    assert sim("ehlxx", "ehllo") == pytest.approx(2 * 3 / 10)  # 3 of 5 characters match in order
    assert sim("hello", "ehllo") == pytest.approx(2 * 4 / 10)  # unsorted: "ello" lines up, the "h" does not
    assert sort_letters.exact_match(" ehllo ", "ehllo") == 1.0
    assert sort_letters.exact_match("hello", "ehllo") == 0.0


def test_sort_letters_task_scores_a_trace():
    (task,) = _tasks("sort-letters", num_train_examples=1)
    answer = task.data.answer
    partial = answer[:2] + "zz"
    assert _score(task.reward, answer) == {"similarity": 1.0}
    assert _score(task.scores, answer) == {"similarity": 1.0, "exact_match": 1.0}
    assert _score(task.reward, partial) == {"similarity": pytest.approx(sort_letters.similarity(partial, answer))}
    assert _score(task.scores, "") == {"similarity": 0.0, "exact_match": 0.0}
    assert _score(task.single_turn, answer) is True

    (exact,) = _tasks("sort-letters", num_train_examples=1, reward="exact")
    assert _score(exact.reward, f" {answer}\n") == {"exact_match": 1.0}
    assert _score(exact.reward, partial) == {"exact_match": 0.0}
    assert _score(exact.scores, partial)["similarity"] == pytest.approx(sort_letters.similarity(partial, answer))


def test_sort_letters_rollout_through_a_scripted_server(rollouts):
    env = _env("sort-letters", num_train_examples=3, seed=1, reward="exact")
    task = v1_tasks(env, "sort-letters")[0]
    (out,), server = rollouts(env, [task], [{"content": f"{task.data.answer}\n"}])
    assert out["reward"] == 1.0 and out["metrics"]["exact_match"] == 1.0 and out["metrics"]["similarity"] == 1.0
    (request,) = server.requests
    assert request["messages"] == sort_letters.make_prompt(_sort_text(task.data.prompt))
    assert "tools" not in request


def test_sort_letters_sft_matches_env_prompt_format():
    tasks = _tasks("sort-letters", num_train_examples=20, seed=7)
    rows = sort_letters.sft_examples(20, seed=7, system_prompt="S")
    assert rows == sort_letters.sft_examples(20, seed=7, system_prompt="S")
    assert len(rows) == 20
    for row in rows:
        (completion,) = row["completion"]
        text = _sort_text(row["prompt"][-1]["content"])
        assert row["prompt"] == sort_letters.make_prompt(text, "S")
        assert completion == {"role": "assistant", "content": "".join(sorted(text))}
    for task in tasks:
        assert sort_letters.make_prompt(_sort_text(task.data.prompt)) == [{"role": "user", "content": task.data.prompt}]
    assert [r["prompt"][-1]["content"] for r in rows] != [t.data.prompt for t in tasks]


def test_sort_letters_sft_cli(tmp_path, capsys):
    out = tmp_path / "sub" / "sft.jsonl"
    cmd = [sys.executable, "-m", "sort_letters", "--sft-out", str(out), "--n", "12", "--seed", "2", "--max-len", "6"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ENV_DIR / "sort_letters")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == sort_letters.sft_examples(12, seed=2, max_len=6)
    assert not list(out.parent.glob(".*tmp"))  # temp file was renamed away
    never = tmp_path / "never.jsonl"
    for bad_args, message in [
        (["--min-len", "9", "--max-len", "3"], "error: max_len (3) must be >= min_len (9)"),
        (["--n", "0"], "error: n must be >= 1, got 0"),
        (["--min-len", "0"], "error: min_len must be >= 1, got 0"),
    ]:
        capsys.readouterr()
        assert sort_letters.main(["--sft-out", str(never), *bad_args]) == 2  # the CLI's exit status
        assert capsys.readouterr().err.strip() == message
        assert not never.exists()


def test_sort_letters_prompt_fits_tiny_context(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = sort_letters.sft_examples(200, seed=0)
    longest = max(rows, key=lambda r: len(r["completion"][0]["content"]))
    enc = tok.apply_chat_template(longest["prompt"] + longest["completion"], tokenize=True, return_dict=True)
    assert len(enc["input_ids"]) <= 64, len(enc["input_ids"])


# ---------------------------------------------------------------- loading by id


@pytest.mark.parametrize(
    "env_id, args, taskset",
    [
        ("reverse-text", {"num_train_examples": 8, "max_len": 6}, reverse_text.ReverseTextTaskset),
        ("tool-calc", {"num_train_examples": 8, "max_turns": 4}, tool_calc.ToolCalcTaskset),
        ("echo-twice", {"num_train_examples": 8}, echo_twice.EchoTwiceTaskset),
        ("sort-letters", {"num_train_examples": 8, "max_len": 6}, sort_letters.SortLettersTaskset),
    ],
)
def test_load_environment_by_id(env_id, args, taskset):
    env = _env(env_id, **args)
    assert is_v1_env(env) and isinstance(env.taskset, taskset)
    tasks = v1_tasks(env, env_id)
    assert len(tasks) == 8
    if "max_len" in args:
        assert all(len(t.data.answer) <= 6 for t in tasks)
    if env_id == "tool-calc":
        assert all(t.config.max_turns == 4 for t in tasks)


@pytest.mark.parametrize(
    "env_id, args, said",
    [
        ("reverse-text", {"max_len": 2}, "max_len (2) must be >= min_len (5)"),
        ("reverse-text", {"reward": "lcs"}, "taskset.reward: Input should be 'similarity' or 'exact'"),
        ("reverse-text", {"user_template": "no placeholder"}, "user_template must contain {text}"),
        ("sort-letters", {"min_len": 0}, "taskset.min_len: Input should be greater than or equal to 1"),
        ("sort-letters", {"num_train_examples": 0}, "taskset.num_train_examples"),
        ("sort-letters", {"num_eval_examples": -1}, "taskset.num_eval_examples"),
        ("tool-calc", {"max_turns": 0}, "taskset.max_turns"),
        ("tool-calc", {"shaping": 2.0}, "taskset.shaping: Input should be less than or equal to 1"),
        ("echo-twice", {"min_len": 5, "max_len": 3}, "need min_len <= max_len"),
        ("echo-twice", {"nope": 1}, "taskset.nope: Extra inputs are not permitted"),
        # classic environments took the system prompt's text; a v1 taskset takes a file
        ("sort-letters", {"system_prompt": "Be brief."}, "system_prompt"),
    ],
)
def test_bad_args_are_one_line_user_errors_naming_the_problem(env_id, args, said):
    with pytest.raises(UserError) as e:
        _env(env_id, **args)
    message = str(e.value)
    assert f"environment '{env_id}'" in message and said in message and "\n" not in message, message


# ---------------------------------------------------------------- environments that are not installed


@pytest.mark.parametrize("env_id", ["math500", "aime2024", "aime2025", "gpqa", "hendrycks-math", "intellect-math"])
def test_prime_rl_hub_environments_say_how_to_install_them(env_id):
    with pytest.raises(
        UserError, match=rf"install it with `prime env install primeintellect/{env_id}` .*needs network"
    ):
        load_env(EnvConfig(id=env_id))


def test_every_missing_environment_is_named_at_once():
    from asyncrl.orchestrator.envs.mixture import EnvMixture

    configs = [EnvConfig(id=i) for i in ("math500", "reverse-text", "no-such-env")]
    with pytest.raises(UserError) as e:
        EnvMixture.load(configs, seq_len=None)
    message = str(e.value)
    assert message.startswith("environments not installed: math500, no-such-env; install them with math500: ")
    assert "`prime env install primeintellect/math500`" in message
    assert "no-such-env: `uv pip install -e environments/no_such_env`" in message


def test_prime_rl_older_benchmark_names():
    from asyncrl.config.eval import EvalConfig

    cfg = loader.load_config(EvalConfig, ["--benchmarks", "math500,aime24,aime25"], {})
    assert cfg.environment_ids == ["math500", "aime2024", "aime2025"]
