"""Config of the `env-server` entrypoint: one verifiers v1 environment served over ZMQ for orchestrators."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import SplitResult, urlsplit

from pydantic import Field, field_validator

from asyncrl.config.base import BaseConfig, LogConfig, default_output_dir
from asyncrl.config.orchestrator import SECRET_VAR, EnvConfig, zmq_address

DEFAULT_KEY_VARS = ("OPENAI_API_KEY",)


def is_plain_http(parts: SplitResult) -> bool:
    """Whether a split URL is http(s) with a host and no user info (`user@host` hides the host from a reader)."""
    return parts.scheme in ("http", "https") and bool(parts.hostname) and "@" not in parts.netloc


def check_allowed_url(url: str) -> str:
    """An `--allow-urls` entry as given, or ValueError saying what one looks like."""
    if not is_plain_http(urlsplit(url)):
        raise ValueError(f"{url!r} is not an http(s) URL like http://10.0.0.2:8000")
    return url


class EnvServerConfig(BaseConfig):
    env: EnvConfig = Field(default_factory=EnvConfig, description="the environment to serve (id and args)")
    address: str = Field(
        "tcp://127.0.0.1:5000",
        description="ZMQ address to bind: tcp://HOST:PORT (0.0.0.0: every "
        "interface; port 0: a free one, printed) or ipc://PATH",
    )
    workers: int = Field(1, ge=1, description="worker processes (above 1: a broker over a pool of servers)")
    max_concurrent: int | None = Field(None, ge=1, description="episodes at once (default: no bound)")
    allow_urls: list[str] = Field(
        default_factory=list,
        description="model endpoints (base URL prefixes, e.g. http://10.0.0.2:8000) requests may have episodes "
        "call; a request naming another is refused (default: loopback hosts only)",
    )
    allow_key_vars: list[str] = Field(
        default_factory=lambda: list(DEFAULT_KEY_VARS),
        description="environment variables requests may have the model client read (its API key variable, "
        "headers from environment variables); a request naming another is refused",
    )
    secret_var: str = Field(
        SECRET_VAR,
        description="environment variable holding a shared secret: when set, only clients with the same secret "
        "get through (ZeroMQ CURVE, encrypted)",
    )
    max_frame_mib: int = Field(64, ge=1, description="a larger request frame drops its connection unread")
    parent_pid: int | None = Field(None, description="exit when this process is gone (set by an orchestrator)")
    output_dir: Path = Field(default_factory=default_output_dir, description="logs go to {output_dir}/logs")
    log: LogConfig = Field(default_factory=LogConfig, description="logging")

    @field_validator("allow_urls")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        return [check_allowed_url(url) for url in urls]

    @field_validator("address")
    @classmethod
    def _zmq_address(cls, address: str) -> str:
        return zmq_address(address)
