"""`rl`: start and supervise inference server, orchestrator(s) and trainer for one RL run, or several ([[runs]])."""

from __future__ import annotations

from asyncrl.config.base import LogConfig
from asyncrl.config.rl import RLConfig, resolve_rl
from asyncrl.config.trainer import TrainerConfig
from asyncrl.entrypoints import entry
from asyncrl.transport.layout import RunLayout

SUMMARY = (
    "RL launcher: `rl @ rl.toml` or `rl --trainer @ t.toml --orchestrator @ o.toml [--inference @ i.toml]`.\n"
    "Shared top-level fields (model, max_steps, seq_len, max_async_level, output_dir, wandb, ckpt, log)\n"
    "are propagated to every component. `rl --bench` runs the bench job (see docs/rl.md).\n"
    "[[runs]] tables in the file: several LoRA runs on one trainer and one server (see docs/rl.md, Multi-run)."
)


def run(config: RLConfig, layout: RunLayout) -> None:
    from asyncrl.launcher.supervisor import launch

    if config.bench:
        from asyncrl.bench.run import run_bench_job

        run_bench_job(config, launch, layout)  # bench and launcher are siblings: the entrypoint wires them
        return
    launch(config, layout)


def trainer(config: RLConfig) -> TrainerConfig:
    return config.trainer  # rl's run dir and checkpoints are its trainer's


def log(config: RLConfig) -> LogConfig:
    return config.log or config.trainer.log


def reports(config: RLConfig, layout: RunLayout) -> list[RunLayout]:
    if not config.report or config.bench:
        return []
    return [layout.run(r.name) for r in config.runs] if config.runs else [layout]  # multi-run: one report per run


def main(argv: list[str] | None = None) -> None:
    entry(
        RLConfig, run, "rl", SUMMARY, argv, resolve=resolve_rl, run_of=trainer, log_of=log, reports=reports, locked=True
    )


if __name__ == "__main__":
    main()
