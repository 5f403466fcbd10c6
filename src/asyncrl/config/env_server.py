"""Config of the `env-server` entrypoint: one verifiers v1 environment served over ZMQ for orchestrators."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from asyncrl.config.base import BaseConfig, LogConfig, default_output_dir
from asyncrl.config.orchestrator import EnvConfig, zmq_address


class EnvServerConfig(BaseConfig):
    env: EnvConfig = Field(default_factory=EnvConfig, description="the environment to serve (id and args)")
    address: str = Field(
        "tcp://127.0.0.1:5000",
        description="ZMQ address to bind: tcp://HOST:PORT (0.0.0.0: every "
        "interface; port 0: a free one, printed) or ipc://PATH",
    )
    workers: int = Field(1, ge=1, description="worker processes (above 1: a broker over a pool of servers)")
    max_concurrent: int | None = Field(None, ge=1, description="episodes at once (default: no bound)")
    parent_pid: int | None = Field(None, description="exit when this process is gone (set by an orchestrator)")
    output_dir: Path = Field(default_factory=default_output_dir, description="logs go to {output_dir}/logs")
    log: LogConfig = Field(default_factory=LogConfig, description="logging")

    @field_validator("address")
    @classmethod
    def _zmq_address(cls, address: str) -> str:
        return zmq_address(address)
