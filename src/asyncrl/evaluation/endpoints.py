"""The endpoints registry of `eval` (PRIME-RL's `configs/endpoints.py`): names -> model, base URL, API-key variable.

The registry is a Python file defining `ENDPOINTS = {name: {"model": ..., "url": ..., "key": ...}}`, where
`key` names the environment variable holding the API key. `eval --model.name NAME` resolves NAME through
it: the server is then reached at `url`, asked for `model`, with the key in `$key`. Invariants:

- `--endpoints-path PATH` given: PATH must load and NAME must be one of its entries (else one-line error
  listing the known names). Not given: `configs/endpoints.py` under the working directory is read when it
  exists, and a name not in it is the plain model name (as before the registry).
- `--client.base-url` / `--client.api-key-var` given on the command line win over the entry's.
- A remote endpoint's key variable must be set; a local one (localhost, 0.0.0.0, 127.x) needs no key.
- Every problem (missing/malformed file, unknown name, unset key) is one UserError line; nothing runs.
"""

from __future__ import annotations

import os
import runpy
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from loguru import logger

from asyncrl.config.eval import EvalConfig
from asyncrl.core.errors import UserError

DEFAULT_PATH = Path("configs/endpoints.py")
FIELDS = ("model", "url", "key")
LOCAL_HOSTS = {"localhost", "0.0.0.0", "::1", "::"}


@dataclass(frozen=True)
class Endpoint:
    name: str
    model: str  # the model id the server serves
    url: str  # OpenAI-compatible base URL, e.g. http://0.0.0.0:8007/v1
    key: str  # environment variable holding the API key

    @property
    def local(self) -> bool:
        host = urlparse(self.url).hostname or ""
        return host in LOCAL_HOSTS or host.startswith("127.")


def _entry(path: Path, name: object, entry: object) -> Endpoint:
    where = f"{path}: ENDPOINTS[{name!r}]"
    if not isinstance(name, str) or not name:
        raise UserError(f"{path}: every ENDPOINTS key must be a non-empty string (the name), not {name!r}")
    if not isinstance(entry, dict):
        raise UserError(f"{where} must be a dict with {', '.join(FIELDS)}, not {type(entry).__name__}")
    missing = [f for f in FIELDS if f not in entry]
    if missing:
        raise UserError(f"{where} lacks {', '.join(repr(f) for f in missing)} (each entry has {', '.join(FIELDS)})")
    extra = sorted(set(entry) - set(FIELDS))
    if extra:
        raise UserError(f"{where} has unknown field(s) {', '.join(map(repr, extra))} (allowed: {', '.join(FIELDS)})")
    bad = [f for f in FIELDS if not isinstance(entry[f], str) or not entry[f].strip()]
    if bad:
        raise UserError(f"{where}[{bad[0]!r}] must be a non-empty string, not {entry[bad[0]]!r}")
    if urlparse(entry["url"]).scheme not in ("http", "https"):
        raise UserError(f"{where}['url'] must be an http(s) base URL like http://0.0.0.0:8007/v1, not {entry['url']!r}")
    return Endpoint(name, entry["model"], entry["url"], entry["key"])


def load_endpoints(path: Path) -> dict[str, Endpoint]:
    """The registry in `path` (a Python file defining ENDPOINTS); UserError on any problem with it."""
    path = Path(path)
    if not path.is_file():
        raise UserError(
            f"--endpoints-path {path} does not exist (a Python file defining ENDPOINTS = {{name: {{...}}}}; "
            f"see {DEFAULT_PATH})"
        )
    try:
        namespace = runpy.run_path(str(path))
    except SyntaxError as e:
        raise UserError(f"{path} is not valid Python (line {e.lineno}: {e.msg})") from e
    except Exception as e:  # the user's file raised while running
        raise UserError(f"{path} failed to load: {type(e).__name__}: {e}") from e
    table = namespace.get("ENDPOINTS")
    if not isinstance(table, dict):
        found = "no ENDPOINTS" if table is None else f"ENDPOINTS is a {type(table).__name__}"
        raise UserError(f"{path} must define ENDPOINTS = {{name: {{'model', 'url', 'key'}}}} ({found})")
    return {name: _entry(path, name, entry) for name, entry in table.items()}


def _pick(config: EvalConfig) -> Endpoint | None:
    name = config.model.name
    explicit = config.endpoints_path is not None
    path = Path(config.endpoints_path) if explicit else DEFAULT_PATH
    if not explicit and not path.is_file():
        return None
    endpoints = load_endpoints(path)
    if name in endpoints:
        return endpoints[name]
    if explicit:
        known = ", ".join(sorted(endpoints)) or "none"
        raise UserError(f"--model.name {name!r} is not an endpoint in {path} (known: {known})")
    return None


def resolve(config: EvalConfig) -> EvalConfig:
    """`config` with `--model.name` resolved through the registry (unchanged when the name is no endpoint)."""
    endpoint = _pick(config)
    if endpoint is None:
        return config
    given = config.client.model_fields_set
    client = config.client.model_copy(
        update={
            **({} if "base_url" in given else {"base_url": endpoint.url}),
            **({} if "api_key_var" in given else {"api_key_var": endpoint.key}),
        }
    )
    if not endpoint.local and not os.environ.get(client.api_key_var):
        raise UserError(
            f"endpoint {endpoint.name!r} reads its API key from ${client.api_key_var}, which is not set: "
            f"export {client.api_key_var}=<key> (or change 'key' in the endpoints file)"
        )
    model = config.model.model_copy(update={"name": endpoint.model})
    logger.info(f"endpoint {endpoint.name!r}: model {endpoint.model} at {client.url} (key from ${client.api_key_var})")
    return config.model_copy(update={"client": client, "model": model})
