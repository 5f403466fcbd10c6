"""`rl`: start and supervise inference server, orchestrator and trainer for one RL run."""

from __future__ import annotations

from asyncrl.config.cli import fail, parse_or_exit
from asyncrl.config.rl import RLConfig, resolve_rl

SUMMARY = (
    "RL launcher: `rl @ rl.toml` or `rl --trainer @ t.toml --orchestrator @ o.toml [--inference @ i.toml]`.\n"
    "Shared top-level fields (model, max_steps, seq_len, max_async_level, output_dir, wandb, ckpt, log)\n"
    "are propagated to every component."
)


def main(argv: list[str] | None = None) -> None:
    parse_or_exit(RLConfig, "rl", SUMMARY, argv, resolve=resolve_rl)
    fail("rl launching is not implemented yet (config parsing and --dry-run work)")


if __name__ == "__main__":
    main()
