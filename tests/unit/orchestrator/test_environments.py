"""The verifiers environments in environments/: data generation, rewards, loading, rollouts.

Rollouts go through verifiers' real OpenAI chat client; only its HTTP transport is replaced by
a scripted one (the real inference server is exercised by the server's own tests).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import verifiers as vf
from openai import AsyncOpenAI

ENV_DIR = Path(__file__).resolve().parents[3] / "environments"
for _name in ("reverse_text", "tool_calc", "echo_twice", "sort_letters"):
    # Editable installs make these importable; a fresh checkout without them still tests.
    if importlib.util.find_spec(_name) is None:
        sys.path.insert(0, str(ENV_DIR / _name))

import echo_twice  # noqa: E402
import reverse_text  # noqa: E402
import sort_letters  # noqa: E402
import tool_calc  # noqa: E402

from asyncrl.config import loader  # noqa: E402
from asyncrl.core.errors import UserError  # noqa: E402

# ---------------------------------------------------------------- helpers


def _assistant(content: str | None = None, tool_calls: list[dict] | None = None) -> Any:
    calls = [vf.ToolCall(**c) for c in tool_calls] if tool_calls else None
    return vf.AssistantMessage(content=content, tool_calls=calls)


def _score(env: vf.Environment, answer: str, completions: list[list[Any]], question: str = "q") -> list[vf.State]:
    """Score hand-written completions with the environment's full rubric (no model involved)."""
    states = []
    for i, completion in enumerate(completions):
        prompt = [vf.UserMessage(content=question)]
        state = vf.State(input={"prompt": prompt, "answer": answer, "example_id": i})
        state.update(prompt=prompt, completion=completion, trajectory=[], info={})
        states.append(state)
    asyncio.run(env.rubric.score_group(states))
    return states


class ScriptedServer:
    """Answers POST /v1/chat/completions with scripted OpenAI-format replies; records requests."""

    def __init__(self, replies: list[dict[str, Any]]):
        self.replies = list(replies)
        self.requests: list[dict[str, Any]] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path.endswith("/chat/completions"), request.url.path
        self.requests.append(json.loads(request.content))
        reply = self.replies.pop(0)
        message: dict[str, Any] = {"role": "assistant", "content": reply.get("content")}
        if "tool_calls" in reply:
            message["tool_calls"] = [
                {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
                for i, (name, args) in enumerate(reply["tool_calls"])
            ]
        body = {
            "id": f"chatcmpl-{len(self.requests)}",
            "object": "chat.completion",
            "created": 0,
            "model": "scripted",
            "choices": [
                {"index": 0, "message": message, "finish_reason": "tool_calls" if "tool_calls" in reply else "stop"}
            ],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
        }
        return httpx.Response(200, json=body)

    def client(self) -> vf.OpenAIChatCompletionsClient:
        http = httpx.AsyncClient(transport=httpx.MockTransport(self.handle))
        oai = AsyncOpenAI(base_url="http://scripted/v1", api_key="x", http_client=http)
        return vf.OpenAIChatCompletionsClient(oai)


def _rollout(env: vf.Environment, server: ScriptedServer, index: int = 0) -> dict[str, Any]:
    row = env.get_dataset()[index]
    inputs = [{"prompt": row["prompt"], "answer": row["answer"], "example_id": row["example_id"]}]
    outputs = asyncio.run(env.run_group(inputs, server.client(), "scripted", {}))
    return outputs[0]


# ---------------------------------------------------------------- reverse-text


def test_reverse_text_dataset_deterministic_and_sized():
    a = reverse_text.load_environment(num_train_examples=50, num_eval_examples=20, seed=3)
    b = reverse_text.load_environment(num_train_examples=50, num_eval_examples=20, seed=3)
    c = reverse_text.load_environment(num_train_examples=50, num_eval_examples=20, seed=4)
    assert len(a.get_dataset()) == 50 and len(a.get_eval_dataset()) == 20
    assert a.get_dataset()["prompt"] == b.get_dataset()["prompt"]
    assert a.get_eval_dataset()["answer"] == b.get_eval_dataset()["answer"]
    assert a.get_dataset()["answer"] != c.get_dataset()["answer"]
    assert a.get_dataset()["answer"][:20] != a.get_eval_dataset()["answer"]
    for row in a.get_dataset():
        (user,) = row["prompt"]
        text = user["content"].removeprefix("Reverse the text: ")
        assert user["content"] == f"Reverse the text: {text}"
        assert 5 <= len(text) <= 8 and text.isalpha() and text.islower()
        assert row["answer"] == text[::-1]


def test_reverse_text_lengths_and_system_prompt():
    env = reverse_text.load_environment(
        num_train_examples=30, num_eval_examples=0, min_len=2, max_len=3, system_prompt="Be brief."
    )
    assert {len(a) for a in env.get_dataset()["answer"]} <= {2, 3}
    assert env.eval_dataset is None
    first = env.get_dataset()[0]["prompt"]
    assert first[0] == {"role": "system", "content": "Be brief."}
    assert first[1]["role"] == "user"


def test_reverse_text_rewards_hand_checked():
    parser = vf.Parser()

    def lcs(text: str) -> float:
        return reverse_text.lcs_reward(parser, [_assistant(text)], "olleh")

    assert lcs("olleh") == 1.0
    assert lcs("  olleh\n") == 1.0  # whitespace is stripped
    assert lcs("") == 0.0
    assert lcs("xyz") == 0.0
    assert lcs("ollxx") == pytest.approx(2 * 3 / 10)  # 3 of 5 characters match in order
    assert lcs("hello") == pytest.approx(2 * 2 / 10)  # unreversed: only "ll" lines up
    assert reverse_text.lcs_reward(parser, [], "olleh") == 0.0  # no assistant message
    assert reverse_text.exact_match(parser, [_assistant(" olleh ")], "olleh") == 1.0
    assert reverse_text.exact_match(parser, [_assistant("olle")], "olleh") == 0.0


def test_reverse_text_rubric_scores_completions():
    env = reverse_text.load_environment(num_train_examples=5, num_eval_examples=0)
    exact, partial, empty = _score(env, "dcba", [[_assistant("dcba")], [_assistant("dcxx")], [_assistant("")]])
    assert exact["reward"] == 1.0 and exact["metrics"]["exact_match"] == 1.0
    assert partial["reward"] == pytest.approx(0.5) and partial["metrics"]["exact_match"] == 0.0
    assert empty["reward"] == 0.0
    assert set(exact["metrics"]) == {"lcs_reward", "exact_match", "num_turns"}


def test_reverse_text_exact_reward_and_user_template():
    env = reverse_text.load_environment(
        num_train_examples=5, num_eval_examples=0, system_prompt="S", user_template="{text}", reward="exact"
    )
    row = env.get_dataset()[0]
    assert row["prompt"] == [{"role": "system", "content": "S"}, {"role": "user", "content": row["answer"][::-1]}]
    exact, partial = _score(env, "dcba", [[_assistant(" dcba")], [_assistant("dcxx")]])
    assert exact["reward"] == 1.0 and partial["reward"] == 0.0
    assert partial["metrics"]["lcs_reward"] == pytest.approx(0.5)
    rows = reverse_text.sft_examples(3, system_prompt="S", user_template="{text}")
    assert rows[0]["prompt"][1]["content"] == rows[0]["completion"][0]["content"][::-1]
    with pytest.raises(ValueError, match="reward must be one of"):
        reverse_text.load_environment(reward="lcs")
    with pytest.raises(ValueError, match="must contain"):
        reverse_text.load_environment(user_template="no placeholder")


def test_reverse_text_rollout_through_openai_client():
    env = reverse_text.load_environment(num_train_examples=3, num_eval_examples=0, seed=1)
    target = env.get_dataset()[0]["answer"]
    server = ScriptedServer([{"content": target}])
    out = _rollout(env, server)
    assert out["reward"] == 1.0 and out["metrics"]["exact_match"] == 1.0
    (request,) = server.requests
    assert request["messages"] == env.get_dataset()[0]["prompt"]
    assert "tools" not in request


def test_reverse_text_sft_matches_env_prompt_format():
    env = reverse_text.load_environment(num_train_examples=20, num_eval_examples=0, seed=7, system_prompt="S")
    rows = reverse_text.sft_examples(20, seed=7, system_prompt="S")
    assert rows == reverse_text.sft_examples(20, seed=7, system_prompt="S")
    assert len(rows) == 20
    for row, env_row in zip(rows, env.get_dataset()):
        (completion,) = row["completion"]
        assert completion["role"] == "assistant"
        text = completion["content"][::-1]
        assert row["prompt"] == reverse_text.make_prompt(text, "S")
        # The env's own prompt for its (different) string has exactly the same shape.
        env_text = env_row["answer"][::-1]
        assert env_row["prompt"] == reverse_text.make_prompt(env_text, "S")
    assert [r["completion"][0]["content"] for r in rows] != env.get_dataset()["answer"]


def test_reverse_text_sft_cli(tmp_path):
    out = tmp_path / "sub" / "sft.jsonl"
    cmd = [sys.executable, "-m", "reverse_text", "--sft-out", str(out), "--n", "12", "--seed", "2", "--max-len", "6"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ENV_DIR / "reverse_text")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == reverse_text.sft_examples(12, seed=2, max_len=6)
    assert not list(out.parent.glob(".*tmp"))  # temp file was renamed away
    bad = subprocess.run(
        cmd[:-4] + ["--min-len", "9", "--max-len", "3"], capture_output=True, text=True, cwd=ENV_DIR / "reverse_text"
    )
    assert bad.returncode == 2 and "max_len (3) must be >= min_len (9)" in bad.stderr


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


def test_calculate_tool_output():
    assert tool_calc.calculate("37 * 12 + 5") == "449"
    assert tool_calc.calculate("6 / 3") == "2"
    assert tool_calc.calculate("1 / 3") == "0.333333333333"


def test_last_number():
    assert tool_calc.last_number("37*12 = 444, plus 5 gives 449.") == 449
    assert tool_calc.last_number("It is -12") == -12
    assert tool_calc.last_number("Total: 1,234") == 1234
    assert tool_calc.last_number("2.50") == 2.5
    assert tool_calc.last_number("no digits") is None


def test_tool_calc_dataset_and_tool_schema():
    a = tool_calc.load_environment(num_train_examples=40, num_eval_examples=10, seed=5)
    b = tool_calc.load_environment(num_train_examples=40, num_eval_examples=10, seed=5)
    assert len(a.get_dataset()) == 40 and len(a.get_eval_dataset()) == 10
    assert a.get_dataset()["prompt"] == b.get_dataset()["prompt"]
    for row in a.get_dataset():
        system, user = row["prompt"]
        assert system["content"] == tool_calc.DEFAULT_SYSTEM_PROMPT
        expr = user["content"].removeprefix("What is ").removesuffix("?")
        assert len(expr.split()) == 5  # three terms, two operators
        assert row["answer"] == str(tool_calc.safe_eval(expr))
    (tool,) = a.tool_defs
    assert tool.name == "calculate"
    assert tool.parameters["required"] == ["expression"]
    assert tool.parameters["properties"]["expression"]["type"] == "string"


def test_tool_calc_rubric_scores_completions():
    env = tool_calc.load_environment(num_train_examples=5, num_eval_examples=0)
    call = {"id": "c0", "name": "calculate", "arguments": json.dumps({"expression": "37*12+5"})}
    right, wrong, none, unfinished = _score(
        env,
        "449",
        [
            [
                _assistant(tool_calls=[call]),
                vf.ToolMessage(tool_call_id="c0", content="449"),
                _assistant("The answer is 449."),
            ],
            [_assistant("37 * 12 + 5 = 450")],
            [_assistant("I don't know")],
            [_assistant("449", tool_calls=[call])],  # still calling tools: not a final answer
        ],
    )
    assert right["reward"] == 1.0
    assert right["metrics"]["total_tool_calls"] == 1 and right["metrics"]["calculate_calls"] == 1
    assert wrong["reward"] == 0.0 and wrong["metrics"]["total_tool_calls"] == 0
    assert none["reward"] == 0.0
    assert unfinished["reward"] == 0.0


def test_tool_calc_shaping_gives_partial_credit():
    call = lambda expr: {"id": "c0", "name": "calculate", "arguments": json.dumps({"expression": expr})}  # noqa: E731
    completions = [
        [
            _assistant(tool_calls=[call("37 * 12 + 5")]),
            vf.ToolMessage(tool_call_id="c0", content="449"),
            _assistant("449"),
        ],
        [
            _assistant(tool_calls=[call("37 * 13 + 5")]),
            vf.ToolMessage(tool_call_id="c0", content="486"),
            _assistant("486"),
        ],
        [_assistant("I don't know")],
    ]
    plain = _score(
        tool_calc.load_environment(num_train_examples=5, num_eval_examples=0),
        "449",
        completions,
        question="What is 37 * 12 + 5?",
    )
    shaped = _score(
        tool_calc.load_environment(num_train_examples=5, num_eval_examples=0, shaping=0.5),
        "449",
        completions,
        question="What is 37 * 12 + 5?",
    )
    right, close, none = shaped
    assert right["metrics"]["expression_similarity"] == 1.0 and right["metrics"]["answer_similarity"] == 1.0
    assert 0.5 < close["metrics"]["expression_similarity"] < 1.0 and 0.0 < close["metrics"]["answer_similarity"] < 1.0
    assert none["metrics"]["expression_similarity"] == 0.0 and none["metrics"]["answer_similarity"] == 0.0
    # without shaping the similarities are only metrics; with it they join the reward
    assert [s["reward"] for s in plain] == [1.0, 0.0, 0.0]
    assert right["reward"] == 1.0 and none["reward"] == 0.0
    expected = 0.25 * (close["metrics"]["expression_similarity"] + close["metrics"]["answer_similarity"])
    assert close["reward"] == pytest.approx(expected)
    with pytest.raises(ValueError, match="shaping must be in"):
        tool_calc.load_environment(shaping=2.0)


def test_tool_calc_rollout_with_openai_tool_calls():
    env = tool_calc.load_environment(num_train_examples=3, num_eval_examples=0, seed=1)
    row = env.get_dataset()[0]
    expr = row["prompt"][-1]["content"].removeprefix("What is ").removesuffix("?")
    server = ScriptedServer(
        [
            {"content": None, "tool_calls": [("calculate", {"expression": expr})]},
            {"content": f"The answer is {row['answer']}."},
        ]
    )
    out = _rollout(env, server)
    assert out["reward"] == 1.0
    assert out["metrics"]["calculate_calls"] == 1 and out["metrics"]["num_turns"] == 2
    first, second = server.requests
    assert first["tools"][0]["function"]["name"] == "calculate"
    tool_msg = second["messages"][-1]
    assert tool_msg == {"role": "tool", "tool_call_id": "call_0", "content": row["answer"]}


def test_tool_calc_rollout_refused_call_and_max_turns():
    env = tool_calc.load_environment(num_train_examples=3, num_eval_examples=0, max_turns=2)
    bad = {"content": None, "tool_calls": [("calculate", {"expression": "__import__('os')"})]}
    server = ScriptedServer([bad, bad, bad])
    out = _rollout(env, server)
    assert len(server.requests) == 2  # max_turns stops the loop
    assert server.requests[1]["messages"][-1]["content"].startswith("Error: unsupported syntax")
    assert out["reward"] == 0.0 and out["metrics"]["total_tool_calls"] == 2


def test_tool_calc_rejects_bad_args():
    with pytest.raises(ValueError, match="max_turns must be >= 1"):
        tool_calc.load_environment(max_turns=0)


# ---------------------------------------------------------------- echo-twice


def test_echo_twice_two_turn_rollout():
    env = echo_twice.load_environment(num_train_examples=4, num_eval_examples=2, seed=2)
    word = env.get_dataset()[0]["answer"]
    assert env.get_dataset()[0]["prompt"][-1]["content"] == f"Say exactly: {word}"
    server = ScriptedServer([{"content": word}, {"content": f" {word}\n"}])
    out = _rollout(env, server)
    assert out["reward"] == 1.0 and out["metrics"]["correct_replies"] == 2.0
    assert out["metrics"]["num_turns"] == 2
    # (verifiers also sends "tool_calls": null and "reasoning_content": null on assistant turns)
    sent = [(m["role"], m["content"]) for m in server.requests[1]["messages"][-2:]]
    assert sent == [("assistant", word), ("user", "Say it again.")]

    server = ScriptedServer([{"content": word}, {"content": "something else"}])
    out = _rollout(env, server)
    assert out["reward"] == 0.0 and out["metrics"]["correct_replies"] == 1.0


def test_echo_twice_dataset_deterministic():
    a = echo_twice.load_environment(num_train_examples=30, num_eval_examples=5, seed=9)
    b = echo_twice.load_environment(num_train_examples=30, num_eval_examples=5, seed=9)
    assert a.get_dataset()["answer"] == b.get_dataset()["answer"]
    assert len(a.get_eval_dataset()) == 5
    assert all(3 <= len(w) <= 6 for w in a.get_dataset()["answer"])


# ---------------------------------------------------------------- sort-letters


def _sort_text(user_content: str) -> str:
    assert user_content.startswith("Sort the letters: "), user_content
    return user_content.removeprefix("Sort the letters: ")


def test_sort_letters_dataset_deterministic_sized_and_split():
    a = sort_letters.load_environment(num_train_examples=50, num_eval_examples=20, seed=3)
    b = sort_letters.load_environment(num_train_examples=50, num_eval_examples=20, seed=3)
    c = sort_letters.load_environment(num_train_examples=50, num_eval_examples=20, seed=4)
    assert len(a.get_dataset()) == 50 and len(a.get_eval_dataset()) == 20
    assert a.get_dataset()["prompt"] == b.get_dataset()["prompt"]
    assert a.get_eval_dataset()["prompt"] == b.get_eval_dataset()["prompt"]
    assert a.get_dataset()["prompt"] != c.get_dataset()["prompt"]
    for row in [*a.get_dataset(), *a.get_eval_dataset()]:
        (user,) = row["prompt"]
        text = _sort_text(user["content"])
        assert 5 <= len(text) <= 8 and text.isalpha() and text.islower()
        assert row["answer"] == "".join(sorted(text))
    # train, eval and sft are independent streams: different strings for the same seed
    train = [_sort_text(r["prompt"][-1]["content"]) for r in a.get_dataset()]
    held_out = [_sort_text(r["prompt"][-1]["content"]) for r in a.get_eval_dataset()]
    sft = [_sort_text(r["prompt"][-1]["content"]) for r in sort_letters.sft_examples(20, seed=3)]
    assert train[:20] != held_out and train[:20] != sft and held_out != sft
    assert train[:20] == sort_letters.random_strings(20, 3, "train", 5, 8)
    assert held_out == sort_letters.random_strings(20, 3, "eval", 5, 8)


def test_sort_letters_lengths_system_prompt_and_no_eval():
    env = sort_letters.load_environment(
        num_train_examples=30, num_eval_examples=0, min_len=2, max_len=3, system_prompt="Be brief."
    )
    assert {len(a) for a in env.get_dataset()["answer"]} <= {2, 3}
    assert env.eval_dataset is None
    first = env.get_dataset()[0]["prompt"]
    assert first[0] == {"role": "system", "content": "Be brief."}
    assert first[1]["role"] == "user"
    assert all(list(a) == sorted(a) for a in env.get_dataset()["answer"])


def test_sort_letters_rewards_hand_checked():
    parser = vf.Parser()

    def sim(text: str) -> float:
        return sort_letters.similarity(parser, [_assistant(text)], "ehllo")

    assert sort_letters.sorted_letters("hello") == "ehllo"
    assert sim("ehllo") == 1.0
    assert sim("  ehllo\n") == 1.0  # whitespace is stripped
    assert sim("") == 0.0
    assert sim("xyz") == 0.0
    assert sim("ehlxx") == pytest.approx(2 * 3 / 10)  # 3 of 5 characters match in order
    assert sim("hello") == pytest.approx(2 * 4 / 10)  # unsorted: "ello" lines up, the "h" does not
    assert sort_letters.similarity(parser, [], "ehllo") == 0.0  # no assistant message
    assert sort_letters.exact_match(parser, [_assistant(" ehllo ")], "ehllo") == 1.0
    assert sort_letters.exact_match(parser, [_assistant("hello")], "ehllo") == 0.0


def test_sort_letters_rubric_scores_completions():
    env = sort_letters.load_environment(num_train_examples=5, num_eval_examples=0)
    right, partial, wrong = _score(env, "abcd", [[_assistant("abcd")], [_assistant("abxx")], [_assistant("zz")]])
    assert right["reward"] == 1.0 and right["metrics"]["exact_match"] == 1.0
    assert partial["reward"] == pytest.approx(0.5) and partial["metrics"]["exact_match"] == 0.0
    assert wrong["reward"] == 0.0 and wrong["metrics"]["exact_match"] == 0.0
    assert set(right["metrics"]) == {"similarity", "exact_match", "num_turns"}

    exact_env = sort_letters.load_environment(num_train_examples=5, num_eval_examples=0, reward="exact")
    right, partial = _score(exact_env, "abcd", [[_assistant(" abcd\n")], [_assistant("abxx")]])
    assert right["reward"] == 1.0 and partial["reward"] == 0.0
    assert partial["metrics"]["similarity"] == pytest.approx(0.5)


def test_sort_letters_rollout_through_openai_client():
    env = sort_letters.load_environment(num_train_examples=3, num_eval_examples=0, seed=1)
    row = env.get_dataset()[0]
    server = ScriptedServer([{"content": row["answer"]}])
    out = _rollout(env, server)
    assert out["reward"] == 1.0 and out["metrics"]["exact_match"] == 1.0
    (request,) = server.requests
    assert request["messages"] == row["prompt"]


def test_sort_letters_sft_matches_env_prompt_format():
    env = sort_letters.load_environment(num_train_examples=20, num_eval_examples=0, seed=7, system_prompt="S")
    rows = sort_letters.sft_examples(20, seed=7, system_prompt="S")
    assert rows == sort_letters.sft_examples(20, seed=7, system_prompt="S")
    assert len(rows) == 20
    for row in rows:
        (completion,) = row["completion"]
        text = _sort_text(row["prompt"][-1]["content"])
        assert row["prompt"] == sort_letters.make_prompt(text, "S")
        assert completion == {"role": "assistant", "content": "".join(sorted(text))}
    assert [r["prompt"] for r in rows] != env.get_dataset()["prompt"]


def test_sort_letters_sft_cli(tmp_path):
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
        bad = subprocess.run(
            [sys.executable, "-m", "sort_letters", "--sft-out", str(never), *bad_args],
            capture_output=True,
            text=True,
            cwd=ENV_DIR / "sort_letters",
        )
        assert bad.returncode == 2 and bad.stderr.strip() == message, bad.stderr
        assert not never.exists()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"min_len": 0}, "min_len must be >= 1, got 0"),
        ({"min_len": 6, "max_len": 5}, r"max_len \(5\) must be >= min_len \(6\)"),
        ({"num_train_examples": 0}, "need num_train_examples >= 1"),
        ({"num_eval_examples": -1}, "num_eval_examples >= 0"),
        ({"reward": "lcs"}, "reward must be one of"),
    ],
)
def test_sort_letters_rejects_bad_args(kwargs, message):
    with pytest.raises(ValueError, match=message):
        sort_letters.load_environment(**kwargs)


def test_sort_letters_prompt_fits_tiny_context(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = sort_letters.sft_examples(200, seed=0)
    longest = max(rows, key=lambda r: len(r["completion"][0]["content"]))
    enc = tok.apply_chat_template(longest["prompt"] + longest["completion"], tokenize=True, return_dict=True)
    assert len(enc["input_ids"]) <= 64, len(enc["input_ids"])


# ---------------------------------------------------------------- loading by id


@pytest.mark.parametrize(
    "env_id, args, cls",
    [
        ("reverse-text", {"num_train_examples": 8, "max_len": 6}, vf.SingleTurnEnv),
        ("tool-calc", {"num_train_examples": 8, "max_turns": 4}, vf.ToolEnv),
        ("echo-twice", {"num_train_examples": 8}, vf.MultiTurnEnv),
        ("sort-letters", {"num_train_examples": 8, "max_len": 6}, vf.SingleTurnEnv),
    ],
)
def test_load_environment_by_id(env_id, args, cls):
    env = vf.load_environment(env_id, **args)
    assert isinstance(env, cls)
    assert env.env_id == env_id and env.env_args == args
    assert len(env.get_dataset()) == 8
    if env_id == "tool-calc":
        assert env.max_turns == 4


def test_load_environment_bad_args_name_the_problem():
    with pytest.raises(RuntimeError, match="max_len \\(2\\) must be >= min_len \\(5\\)"):
        vf.load_environment("reverse-text", max_len=2)


def test_tool_calc_sft_rows_replay_as_rewarded_rollouts(tiny_model_dir):
    """An SFT row is exactly a rollout the env gives reward 1, with the same `tools` verifiers sends,
    and SFT trains on the model's turns (tool call, answer) only, never on the tool's reply."""
    from transformers import AutoTokenizer

    from asyncrl.trainer.sft.data import ConversationTokenizer

    rows = tool_calc.sft_examples(4, seed=3)
    assert len({r["prompt"][-1]["content"] for r in rows}) == 4
    env = tool_calc.load_environment(num_train_examples=3, num_eval_examples=0, seed=3)
    row = rows[0]
    call, tool_reply, answer = row["completion"]
    fn = call["tool_calls"][0]["function"]
    server = ScriptedServer(
        [
            {"content": None, "tool_calls": [(fn["name"], json.loads(fn["arguments"]))]},
            {"content": answer["content"]},
        ]
    )
    inputs = [{"prompt": row["prompt"], "answer": answer["content"], "example_id": 0}]
    (out,) = asyncio.run(env.run_group(inputs, server.client(), "scripted", {}))
    assert out["reward"] == 1.0 and out["metrics"]["calculate_calls"] == 1
    assert server.requests[0]["tools"] == row["tools"]
    assert server.requests[1]["messages"][-1]["content"] == tool_reply["content"]

    conv = ConversationTokenizer(AutoTokenizer.from_pretrained(tiny_model_dir), ["assistant"])
    sample = conv.tokenize_row(row, 0)
    trained = conv.tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m])
    assert fn["arguments"] in trained and trained.endswith(answer["content"] + "<|im_end|>\n")
    assert "<tool_response>" not in trained and "What is" not in trained


def test_tool_calc_sft_cli(tmp_path):
    out = tmp_path / "sft.jsonl"
    cmd = [sys.executable, "-m", "tool_calc", "--sft-out", str(out), "--n", "6", "--seed", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ENV_DIR / "tool_calc")
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(line) for line in out.read_text().splitlines()] == tool_calc.sft_examples(6, seed=1)
    assert not list(tmp_path.glob(".*tmp"))
    never = tmp_path / "never.jsonl"
    bad = subprocess.run(
        [sys.executable, "-m", "tool_calc", "--sft-out", str(never), "--n", "0"],
        capture_output=True,
        text=True,
        cwd=ENV_DIR / "tool_calc",
    )
    assert bad.returncode == 2 and "n must be >= 1" in bad.stderr and not never.exists()


@pytest.mark.parametrize("env_id", ["math500", "aime2024", "aime2025", "gpqa", "hendrycks-math", "intellect-math"])
def test_prime_rl_hub_environments_say_how_to_install_them(env_id):
    from asyncrl.config.orchestrator import EnvConfig
    from asyncrl.orchestrator.envs import load_env

    with pytest.raises(
        UserError, match=rf"install it with `prime env install primeintellect/{env_id}` .*needs network"
    ):
        load_env(EnvConfig(id=env_id))


def test_every_missing_environment_is_named_at_once():
    from asyncrl.config.orchestrator import EnvConfig
    from asyncrl.orchestrator.envs import EnvMixture

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
