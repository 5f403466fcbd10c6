"""`rl`: start and supervise inference server, orchestrator(s) and trainer for one RL run, or several ([[runs]])."""

from __future__ import annotations

from asyncrl.config.cli import parse_or_exit, run_guarded
from asyncrl.config.rl import RLConfig, resolve_rl
from asyncrl.utils.logging import setup_logger

SUMMARY = (
    "RL launcher: `rl @ rl.toml` or `rl --trainer @ t.toml --orchestrator @ o.toml [--inference @ i.toml]`.\n"
    "Shared top-level fields (model, max_steps, seq_len, max_async_level, output_dir, wandb, ckpt, log)\n"
    "are propagated to every component. `rl --bench` runs the benchmark job (see README, RL).\n"
    "[[runs]] tables in the file: several LoRA runs on one trainer and one server (see README, Multi-run)."
)


def main(argv: list[str] | None = None) -> None:
    config = parse_or_exit(RLConfig, "rl", SUMMARY, argv, resolve=resolve_rl)
    log = config.log or config.trainer.log
    setup_logger("rl", config.trainer.output_dir, log.level, log.file)

    def run() -> None:
        if config.bench:
            from asyncrl.bench.run import run_bench

            run_bench(config)
            return
        from asyncrl.launcher import launch

        launch(config)

    try:
        run_guarded(run)
    finally:  # after run_guarded: rl's own record has its exit by then
        if config.report and not config.bench:
            from asyncrl.report.report import report_at_end

            for run in [r.name for r in config.runs] if config.runs else [None]:  # multi-run: one report per run
                report_at_end(config.trainer.output_dir / f"run_{run}" if run else config.trainer.output_dir)


if __name__ == "__main__":
    main()
