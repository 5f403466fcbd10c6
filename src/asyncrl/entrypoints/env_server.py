"""`env-server`: Serve one verifiers v1 environment over ZMQ for orchestrators (verifiers' serve_env)."""

from __future__ import annotations

from asyncrl.config.env_server import EnvServerConfig
from asyncrl.entrypoints import entry
from asyncrl.transport.layout import RunLayout

SUMMARY = "Serve one verifiers v1 environment over ZMQ, for orchestrators ([[orchestrator.env]] server.address)."


def run(config: EnvServerConfig, _layout: RunLayout) -> None:  # writes nothing under a run dir
    from asyncrl.orchestrator.envs.server import serve

    serve(config)


def main(argv: list[str] | None = None) -> None:
    entry(EnvServerConfig, run, "env-server", SUMMARY, argv)


if __name__ == "__main__":
    main()
