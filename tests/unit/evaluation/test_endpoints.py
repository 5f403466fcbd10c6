"""The endpoints registry of `eval` (configs/endpoints.py): loading, resolving a name, and each one-line error."""

from pathlib import Path

import pytest

from asyncrl.config.eval import EvalConfig
from asyncrl.config.loader import load_config
from asyncrl.core.errors import UserError
from asyncrl.evaluation.endpoints import load_endpoints, resolve

REPO = Path(__file__).resolve().parents[3]
REGISTRY = """
ENDPOINTS = {
    "local-qwen": {"model": "Qwen/Qwen3-0.6B", "url": "http://0.0.0.0:8007/v1", "key": "local"},
    "gpt": {"model": "gpt-4.1-mini", "url": "https://api.openai.com/v1", "key": "ASYNCRL_TEST_OPENAI_KEY"},
}
"""


@pytest.fixture
def registry(tmp_path) -> Path:
    path = tmp_path / "endpoints.py"
    path.write_text(REGISTRY)
    return path


def config(*argv: str) -> EvalConfig:
    return load_config(EvalConfig, ["--environment-ids", "reverse-text", *argv], environ={})


def test_shipped_registry_has_the_docs_entry():
    endpoints = load_endpoints(REPO / "configs/endpoints.py")
    qwen = endpoints["Qwen/Qwen2.5-7B-Instruct"]
    assert (qwen.model, qwen.url, qwen.key) == ("Qwen/Qwen2.5-7B-Instruct", "http://0.0.0.0:8007/v1", "local")
    assert qwen.local


def test_name_resolves_to_model_url_and_key(registry, monkeypatch):
    monkeypatch.setenv("ASYNCRL_TEST_OPENAI_KEY", "sk-test")
    done = resolve(config("--model.name", "gpt", "--endpoints-path", str(registry)))
    assert (done.model.name, done.client.url, done.client.api_key_var) == (
        "gpt-4.1-mini",
        "https://api.openai.com/v1",
        "ASYNCRL_TEST_OPENAI_KEY",
    )


def test_flags_given_win_over_the_entry(registry):
    done = resolve(
        config("--model.name", "local-qwen", "--endpoints-path", str(registry), "--client.base-url", "http://h:9/v1")
    )
    assert (done.model.name, done.client.url, done.client.api_key_var) == ("Qwen/Qwen3-0.6B", "http://h:9/v1", "local")


def test_local_endpoint_needs_no_key(registry, monkeypatch):
    monkeypatch.delenv("local", raising=False)
    assert resolve(config("--model.name", "local-qwen", "--endpoints-path", str(registry))).model.name == (
        "Qwen/Qwen3-0.6B"
    )


def test_unset_key_of_a_remote_endpoint_is_one_line(registry, monkeypatch):
    monkeypatch.delenv("ASYNCRL_TEST_OPENAI_KEY", raising=False)
    with pytest.raises(UserError, match=r"\$ASYNCRL_TEST_OPENAI_KEY, which is not set") as e:
        resolve(config("--model.name", "gpt", "--endpoints-path", str(registry)))
    assert "\n" not in str(e.value)


def test_unknown_name_lists_the_known_ones(registry):
    with pytest.raises(UserError, match=r"'nope' is not an endpoint in .* \(known: gpt, local-qwen\)"):
        resolve(config("--model.name", "nope", "--endpoints-path", str(registry)))


def test_without_the_flag_a_name_outside_the_default_registry_is_the_plain_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/endpoints.py here
    plain = config("--model.name", "some/model")
    assert resolve(plain) is plain
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs/endpoints.py").write_text(REGISTRY)
    assert resolve(plain) is plain  # not an entry: the name as given
    assert resolve(config("--model.name", "local-qwen")).client.url == "http://0.0.0.0:8007/v1"


@pytest.mark.parametrize(
    "text, message",
    [
        ("ENDPOINTS = {", r"is not valid Python \(line 1"),
        ("import nothing_here_xyz", r"failed to load: ModuleNotFoundError"),
        ("OTHER = {}", r"must define ENDPOINTS = .* \(no ENDPOINTS\)"),
        ("ENDPOINTS = []", r"\(ENDPOINTS is a list\)"),
        ("ENDPOINTS = {'a': 'http://x'}", r"ENDPOINTS\['a'\] must be a dict"),
        ("ENDPOINTS = {'a': {'model': 'm', 'url': 'http://x/v1'}}", r"ENDPOINTS\['a'\] lacks 'key'"),
        ("ENDPOINTS = {'a': {'model': 'm', 'url': 'http://x/v1', 'key': 'K', 'api': 1}}", r"unknown field\(s\) 'api'"),
        ("ENDPOINTS = {'a': {'model': '', 'url': 'http://x/v1', 'key': 'K'}}", r"\['model'\] must be a non-empty"),
        ("ENDPOINTS = {'a': {'model': 'm', 'url': 'x:8000', 'key': 'K'}}", r"\['url'\] must be an http\(s\) base URL"),
        (
            "ENDPOINTS = {1: {'model': 'm', 'url': 'http://x/v1', 'key': 'K'}}",
            r"every ENDPOINTS key must be a non-empty string",
        ),
    ],
)
def test_malformed_registry_is_one_line(tmp_path, text, message):
    path = tmp_path / "endpoints.py"
    path.write_text(text)
    with pytest.raises(UserError, match=message) as e:
        load_endpoints(path)
    assert "\n" not in str(e.value) and str(path) in str(e.value)


def test_missing_registry_file_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"--endpoints-path .*missing.py does not exist"):
        resolve(config("--model.name", "a", "--endpoints-path", str(tmp_path / "missing.py")))
