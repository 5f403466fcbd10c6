"""Config of the `rl` launcher: the three component configs plus shared fields set once at the top.

Shared fields (`model`, `max_steps`, `seq_len`, `max_async_level`, `output_dir`, `wandb`, `ckpt`, `log`) are
propagated into every component that has them. A value may be set at the top or in any one component
(`ckpt` is one setting for the run: `[ckpt]`, `[trainer.ckpt]` and `[orchestrator.ckpt]` alike; `async_level`
is `max_async_level`). A value given on the command line wins over every config file (PRIME-RL's precedence:
CLI > files > env > defaults); two files, or two flags, that set different values are an error, never a silent
overwrite. The top level of the result says what the components run with (`--dry-run` prints it).
With `bench`, the bench job's settings (`asyncrl.config.bench`) fill in whatever the user left unset.

`[teacher]` (on-policy distillation) is a second inference server rl starts for the orchestrator to score
samples with: its own model (never the shared `model`, never sent weights), the run's `output_dir` and log
level, `max_model_len` = `seq_len`, port `inference.server.port + 1` unless set; `orchestrator.teacher`'s
host and port point at it unless `orchestrator.teacher.base_url` names another server.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from asyncrl.config import bench as bench_job
from asyncrl.config import loader
from asyncrl.config.base import (
    BaseConfig,
    CkptConfig,
    LogConfig,
    ModelConfig,
    WandbConfig,
    async_level_field,
    fold_async_level,
    report_field,
)
from asyncrl.config.inference import InferenceConfig, chosen_backend
from asyncrl.config.orchestrator import OrchestratorConfig
from asyncrl.config.trainer import RunConfig, TrainerConfig
from asyncrl.core.errors import UserError
from asyncrl.transport.layout import RUN_NAME, RUN_NAME_RULE, run_dir


class RunSpec(BaseConfig):
    """One run of a multi-run `rl` (`[[runs]]`): its own settings over the shared ones (see docs/rl.md, Multi-run)."""

    name: str = Field(description="run name: its dir {output_dir}/run_NAME and the model name of its adapter")
    max_steps: int | None = Field(None, ge=1, description="the run's steps (default: max_steps)")
    lr: float | None = Field(None, gt=0, description="the run's learning rate (shorthand for trainer.optim.lr)")
    orchestrator: dict[str, Any] = Field(
        default_factory=dict, description="the run's orchestrator settings, over [orchestrator] (env, sampling, ...)"
    )
    trainer: RunConfig = Field(
        default_factory=RunConfig, description="the run's trainer settings (optim, scheduler, loss, ckpt, seed)"
    )

    @model_validator(mode="after")
    def _check(self) -> RunSpec:
        if not RUN_NAME.match(self.name):
            raise ValueError(f"run name {self.name!r}: use {RUN_NAME_RULE} (it becomes a model name)")
        if self.lr is not None and self.trainer.optim is not None and "lr" in self.trainer.optim.model_fields_set:
            raise ValueError(f"run {self.name!r} sets lr twice (lr and trainer.optim.lr); set it once")
        return self

    def run_settings(self) -> dict[str, Any]:
        """The run's run.toml: what it sets of the trainer's settings."""
        raw = self.trainer.model_dump(mode="json", exclude_unset=True)
        if self.lr is not None:
            raw.setdefault("optim", {})["lr"] = self.lr
        if self.max_steps is not None:
            raw["max_steps"] = self.max_steps
        return raw


class RLConfig(BaseConfig):
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="trainer (see `trainer --help`)")
    orchestrator: OrchestratorConfig = Field(
        default_factory=OrchestratorConfig, description="orchestrator (see `orchestrator --help`)"
    )
    inference: InferenceConfig | None = Field(
        None, description="start an inference server (off: use orchestrator.client's server)"
    )
    teacher: InferenceConfig | None = Field(
        None,
        description="on-policy distillation: start a teacher server (an inference config; its own [teacher.model]) "
        "for the orchestrator to score samples with (off: orchestrator.teacher's running server, if any)",
    )
    model: ModelConfig | None = Field(None, description="shared: model of all components")
    max_steps: int | None = Field(None, ge=1, description="shared: training steps")
    seq_len: int | None = Field(None, ge=1, description="shared: packed row length (and server context)")
    max_async_level: int | None = Field(None, ge=0, description="shared: async bound k (default 2)")
    async_level: int | None = async_level_field()
    output_dir: Path | None = Field(None, description="shared: run directory (default outputs)")
    wandb: WandbConfig | None = Field(None, description="shared: W&B (runs get -trainer/-orchestrator suffixes)")
    ckpt: CkptConfig | None = Field(None, description="shared: checkpointing of trainer and orchestrator")
    log: LogConfig | None = Field(None, description="shared: log level of all components")
    inference_gpu_ids: list[int] = Field(default_factory=lambda: [0], description="GPUs of the inference server")
    trainer_gpu_ids: list[int] = Field(default_factory=lambda: [1], description="GPUs of the trainer (one rank each)")
    teacher_gpu_ids: list[int] | None = Field(
        None, description="GPUs of the teacher server (default: the inference server's; it starts after that one)"
    )
    inference_gpus: int | None = Field(
        None, ge=1, description="older spelling: the first N GPUs serve inference (sets inference_gpu_ids)"
    )
    trainer_gpus: int | None = Field(
        None, ge=1, description="older spelling: the N GPUs after the inference ones train (sets trainer_gpu_ids)"
    )
    trainer_cpu_processes: int = Field(1, ge=1, description="trainer ranks when running on CPU")
    cpu_placement: Literal["split", "pinned", "shared"] = Field(
        "split",
        description="without CUDA, how inference and trainer share the cores: split (half the threads each), "
        "pinned (split, each on its own cores), shared (every core to both, time-sharing)",
    )
    exp_id: str | None = Field(None, description="experiment id: runs in {output_dir}/{exp_id}, side by side")
    report: bool = report_field()
    stall_timeout: float = Field(
        1800.0, ge=0, description="seconds without a step before rl stops the run, naming what looks hung (0: never)"
    )
    max_restarts: int = Field(
        3,
        ge=0,
        description="a run that checkpoints ([ckpt]): when a process dies, restart the run from its latest complete "
        "checkpoint, at most this many times (0: stop it, as a run without [ckpt] always does)",
    )
    restart_backoff: float = Field(
        10.0,
        ge=0,
        description="seconds before a restart; doubled for each restart in a row that saved no new checkpoint",
    )
    runs: list[RunSpec] | None = Field(
        None,
        description="multi-run: [[runs]] tables, one LoRA run each (own orchestrator, adapter, optimizer) on one "
        "trainer and one server",
    )
    bench: bool = Field(
        False,
        description="run the bench job (tiny-Qwen3 reverse-text GRPO, the comparison with TRL) on a model it warms "
        "itself, print s/step, generation/training/weight-update time, overlap and held-out accuracy, write "
        "{output_dir}/bench.json (other flags still apply)",
    )

    @model_validator(mode="before")
    @classmethod
    def _async_level(cls, raw: Any) -> Any:
        return fold_async_level(raw)

    @model_validator(mode="after")
    def _check(self) -> RLConfig:
        if self.trainer.data.seq_len is None:  # the trainer accepts the rows its orchestrator(s) pack
            run_lens = [r.orchestrator.get("seq_len") for r in self.runs or []]
            lens = [self.orchestrator.seq_len] + [n for n in run_lens if isinstance(n, int)]
            self.trainer.data.seq_len = max(lens)
        if self.runs is not None:
            self._check_runs()
        if self.orchestrator.lora_name is not None and self.trainer.model.lora is None:
            raise ValueError(
                f"orchestrator.lora_name = {self.orchestrator.lora_name!r} serves LoRA adapters, but the trainer "
                "trains the full model: add --trainer.model.lora (or drop --orchestrator.lora-name)"
            )
        if self.inference is not None:
            mml = self.inference.model.max_model_len
            if mml is not None and mml < self.orchestrator.seq_len:
                raise ValueError(
                    f"inference.model.max_model_len ({mml}) is below seq_len ({self.orchestrator.seq_len}); "
                    "raise it or lower seq_len"
                )
        if self.teacher is not None:
            self._check_teacher()
        if self.trainer.model.router_replay:
            self._check_replay()
        if self.trainer.model.ep > 1:
            self._check_ep()
        self.orchestrator_keys()
        return self

    def _check_replay(self) -> None:
        if _dense(self.trainer.model.name):
            raise ValueError(
                f"trainer.model.router_replay: {self.trainer.model.name} is not a mixture of experts (its config.json "
                "names no experts); set router_replay = false"
            )
        if self.inference is not None and not self.inference.enable_return_routed_experts:
            raise ValueError(
                "trainer.model.router_replay needs the routes the server records: drop "
                "inference.enable_return_routed_experts = false"
            )

    def _check_ep(self) -> None:
        ep, experts = self.trainer.model.ep, _experts(self.trainer.model.name)
        if experts == 0:
            raise ValueError(
                f"trainer.model.ep = {ep}: {self.trainer.model.name} is not a mixture of experts (its config.json "
                "names no experts); set trainer.model.ep = 1"
            )
        if experts and experts % ep:
            raise ValueError(
                f"trainer.model.ep = {ep} does not divide the model's {experts} experts: use a trainer.model.ep "
                "that does"
            )

    def orchestrator_keys(self) -> dict[str, str]:
        """{variable: key}: the `api_key` of each server rl starts with one that the orchestrator reaches at rl's
        address (no `base_url`), in the variable its client reads (`api_key_var`); rl sets them in the
        orchestrator's environment. A ValueError when two keys would share one variable."""
        keys: dict[str, tuple[str, str]] = {}
        pairs = [
            ("inference", self.inference, self.orchestrator.client),
            ("teacher", self.teacher, self.orchestrator.teacher),
        ]
        for role, server, client in pairs:
            if server is None or not server.api_key or client is None or client.base_url is not None:
                continue
            var = client.api_key_var
            if var in keys and keys[var][1] != server.api_key:
                raise ValueError(
                    f"the {keys[var][0]} and {role} servers rl starts have different api_key values, but the "
                    f"orchestrator reads both from ${var}: give the teacher's its own variable "
                    "(--orchestrator.teacher.api-key-var TEACHER_API_KEY) or use one key"
                )
            keys[var] = (role, server.api_key)
        return {var: key for var, (_, key) in keys.items()}

    def _check_teacher(self) -> None:
        port = self.teacher.server.port
        if self.inference is not None and port == self.inference.server.port:
            raise ValueError(
                f"teacher.server.port ({port}) is the inference server's port; give the teacher its own "
                "(--teacher.server.port)"
            )
        mml = self.teacher.model.max_model_len
        if mml is not None and mml < self.orchestrator.seq_len:
            raise ValueError(
                f"teacher.model.max_model_len ({mml}) is below seq_len ({self.orchestrator.seq_len}); the teacher "
                "scores whole samples: raise it"
            )

    def _check_runs(self) -> None:
        names = [r.name for r in self.runs]
        if not names:
            raise ValueError("runs is empty: give at least one [[runs]] table (or none for a single run)")
        if len(set(names)) < len(names):
            raise ValueError(f"run names must differ, got {names}")
        if self.trainer.model.lora is None:
            raise ValueError("[[runs]] train one LoRA adapter each on the shared base model: add [trainer.model.lora]")
        if self.orchestrator.lora_name is not None:
            raise ValueError("with [[runs]] each run's adapter is served as the run name: drop orchestrator.lora_name")
        if self.bench:
            raise ValueError("--bench runs the bench job, a single run: drop [[runs]]")
        if self.inference is not None and len(names) > self.inference.max_lora_adapters:
            raise ValueError(
                f"{len(names)} [[runs]] need {len(names)} LoRA adapters on the server, which loads at most "
                f"{self.inference.max_lora_adapters}: raise --inference.max-lora-adapters"
            )

    def run_orchestrators(self) -> dict[str, OrchestratorConfig]:
        """Each run's orchestrator: [orchestrator] with the run's settings over it, writing to run_NAME/ and
        serving its adapter as NAME; a bad setting is a UserError naming the run."""
        base = self.orchestrator.model_dump(mode="json")
        configs = {}
        for run in self.runs or []:
            try:
                raw = loader.deep_merge(base, fold_async_level(run.orchestrator))
            except ValueError as e:
                raise UserError(f"[[runs]] {run.name!r}: {e}") from None
            raw.update(output_dir=str(run_dir(self.trainer.output_dir, run.name)), lora_name=run.name)
            if run.max_steps is not None:
                raw["max_steps"] = run.max_steps
            if raw.get("wandb") is not None:  # a copy: deep_merge shares the base's nested dicts with every run
                wandb = raw["wandb"] = dict(raw["wandb"])
                wandb["name"] = f"{wandb.get('name') or 'orchestrator'}-{run.name}"
                if wandb.get("id"):  # one W&B run per run, not all resuming into one
                    wandb["id"] = f"{wandb['id']}-{run.name}"
            try:
                configs[run.name] = loader.validate(OrchestratorConfig, raw)
            except UserError as e:
                raise UserError(f"[[runs]] {run.name!r}: {e}") from None
        return configs


# shared field -> where it lives in each component (None: component lacks it)
SHARED: dict[str, dict[str, tuple[str, ...] | None]] = {
    "model.name": {"trainer": ("model", "name"), "orchestrator": ("model", "name"), "inference": ("model", "name")},
    "max_steps": {"trainer": ("max_steps",), "orchestrator": ("max_steps",), "inference": None},
    "seq_len": {"trainer": ("data", "seq_len"), "orchestrator": ("seq_len",), "inference": None},
    "max_async_level": {"trainer": ("max_async_level",), "orchestrator": ("max_async_level",), "inference": None},
    "output_dir": {"trainer": ("output_dir",), "orchestrator": ("output_dir",), "inference": ("output_dir",)},
}
SHARED_SECTIONS = ("wandb", "log")  # `ckpt` is the run's, one setting for both processes: see `_run_checkpoints`
CKPT_PLACES = ("trainer", "orchestrator")
# each component logs its own W&B run: its own value wins; a shared one (top level, file or flag) is made the
# component's (`--wandb.name X`: X-trainer, X-orchestrator; `--wandb.id X` as well, or both would resume one run)
PER_RUN = {("wandb", "name"), ("wandb", "id")}


def _same(a: Any, b: Any) -> bool:
    return str(a) == str(b) if isinstance(a, (str, Path)) or isinstance(b, (str, Path)) else a == b


def _explicit(raw: dict, top: tuple[str, ...], where: dict[str, tuple[str, ...] | None]) -> list[tuple[str, Any]]:
    """(where, value) of every explicit setting of one shared field in `raw`: the top level first."""
    found = [("top level", loader.get_path(raw, top))]
    found += [
        (c, loader.get_path(raw[c], p)) for c, p in where.items() if p is not None and isinstance(raw.get(c), dict)
    ]
    return [(name, value) for name, value in found if value is not None]


def _agreed(
    field: str, values: list[tuple[str, Any]], where: dict, origin: str, hint: str = "set it once (at the top level)"
) -> Any:
    """The one value all `values` agree on; UserError naming two that do not."""
    (first, value), key = values[0], (lambda n: field if n == "top level" else f"{n}.{'.'.join(where[n])}")
    for name, other in values[1:]:
        if not _same(other, value):
            raise UserError(
                f"contradicting {field}: {key(first)} = {value!r} but {key(name)} = {other!r} ({origin}); {hint}"
            )
    return value


def _run_checkpoints(raw: dict, cli: dict) -> None:
    """One checkpoint setting for the run: `[ckpt]`, `[trainer.ckpt]` and `[orchestrator.ckpt]` are the same
    section. Set in any of them (the guide's `[trainer.ckpt]` + `--trainer.ckpt.resume-step N`), both processes
    save at the same steps, under the same path, with the same retention, and resume at the same step: the
    orchestrator's part of `step_N` is what a resume needs besides the trainer's. A key given on the command line
    wins over the files; two places that set it differently (both files, or both flags) are a contradiction.
    `--no-ckpt` (top level) turns checkpoints off; `--orchestrator.no-ckpt` / `--trainer.no-ckpt` only that one."""
    places = {"top level": raw, **{c: raw[c] for c in CKPT_PLACES}}
    flags = {name: cli if name == "top level" else cli.get(name) or {} for name in places}
    off = {name for name, f in flags.items() if "ckpt" in f and f["ckpt"] is None}
    given = {name: tree["ckpt"] for name, tree in places.items() if isinstance(tree.get("ckpt"), dict)}
    if "top level" in off or not given:
        for name in places if "top level" in off else ():
            places[name]["ckpt"] = None
        return
    run: dict = {}
    for key in sorted({k for section in given.values() for k in section}):
        on_line = [(n, flags[n]["ckpt"][key]) for n in given if key in (flags[n].get("ckpt") or {})]
        values = on_line or [(n, section[key]) for n, section in given.items() if key in section]
        run[key] = _agreed_ckpt(key, values, "on the command line" if on_line else "in the config files")
    for name, tree in places.items():
        if name not in off and (name != "top level" or "top level" in given):
            tree["ckpt"] = dict(run)


def _agreed_ckpt(key: str, values: list[tuple[str, Any]], origin: str) -> Any:
    """The one value of `ckpt.<key>` all places agree on; UserError naming two that do not."""
    where = {name: ("ckpt", key) for name in CKPT_PLACES}
    hint = "the run's processes checkpoint together: set it once (at the top level, [ckpt])"
    return _agreed(f"ckpt.{key}", values, where, origin, hint)


def _fold_async_levels(raw: dict) -> dict:
    """A copy of `raw` (two levels deep) with `async_level` folded into `max_async_level` at the top level and in
    each component, so that propagation sees one option (`base.fold_async_level`)."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    try:
        out = fold_async_level(out)
        for comp in loader.COMPONENTS:
            if isinstance(out.get(comp), dict):
                out[comp] = fold_async_level(out[comp])
    except ValueError as e:
        raise UserError(str(e)) from None
    return out


def _takes_shared(raw: dict, cli: dict, comp: str, section: str, key: str) -> bool:
    """Whether `comp` gets the top-level `section.key`: it has no value of its own on the command line, and
    none in its files unless a top-level flag overrides that."""
    own = raw[comp].get(section) or {}
    own_flags = (cli.get(comp) or {}).get(section) or {}
    return key not in own_flags and (key in (cli.get(section) or {}) or key not in own)


def _per_run_value(key: str, value: Any, comp: str, takers: list[str]) -> Any:
    """A shared W&B name or id as `comp`'s: a name always gets the component's suffix (X-trainer); an id gets it
    when two components take it (one id on two runs would resume them into one W&B run)."""
    if value is None or (key == "id" and len(takers) < 2):
        return value
    return f"{value}-{comp}"


def propagate(raw: dict, cli: dict | None = None) -> dict:
    """Fill shared fields into components. A shared value given on the command line (`cli`, at the top or
    in one component) wins over every file, as in PRIME-RL's precedence; two files, or two command-line
    flags, that set different values are a contradiction (UserError)."""
    raw, cli = _fold_async_levels(raw), _fold_async_levels(cli or {})
    raw.setdefault("trainer", {})
    raw.setdefault("orchestrator", {})
    components = [c for c in loader.COMPONENTS if isinstance(raw.get(c), dict)]
    _propagate_fields(raw, cli, components)
    _run_checkpoints(raw, cli)
    _propagate_sections(raw, cli, components)
    _point_at_inference(raw)
    _record_routes_for_replay(raw)
    return raw


def _propagate_fields(raw: dict, cli: dict, components: list[str]) -> None:
    """Each shared field (`SHARED`) set once, on the command line or in the files, into every component."""
    for shared, where in SHARED.items():
        top = tuple(shared.split("."))
        given = _explicit(cli, top, where)
        values = given or _explicit(raw, top, where)
        if not values:
            continue
        value = _agreed(shared, values, where, "on the command line" if given else "in the config files")
        for comp in components:
            if where[comp] is not None:
                loader.set_path(raw[comp], where[comp], value)
        if loader.get_path(raw, top) is not None:  # --dry-run prints what the components run with
            loader.set_path(raw, top, value)


def _propagate_sections(raw: dict, cli: dict, components: list[str]) -> None:
    """Each top-level shared section (`SHARED_SECTIONS`) merged under the components' own."""
    for section in SHARED_SECTIONS:
        top = raw.get(section)
        if top is None:
            continue
        comps = ("trainer", "orchestrator") if section != "log" else components
        takers = {key: [c for c in comps if _takes_shared(raw, cli, c, section, key)] for key in top}
        for comp in comps:
            own = dict(raw[comp].get(section) or {})
            for key, value in top.items():
                _merge_key(own, cli, (comp, section, key), value, takers[key])
            raw[comp][section] = loader.deep_merge(top, own)


def _merge_key(own: dict, cli: dict, where: tuple[str, str, str], value: Any, takers: list[str]) -> None:
    """A shared section's `key` into component `comp`'s own section `own`: a per-run value (`PER_RUN`) made
    the component's, else the command line's, else the top level's, which a different own value contradicts."""
    comp, section, key = where
    top_flags, own_flags = cli.get(section) or {}, (cli.get(comp) or {}).get(section) or {}
    per_run = (section, key) in PER_RUN  # a component's own value is meant to differ
    if key in top_flags and key in own_flags and not _same(top_flags[key], own_flags[key]) and not per_run:
        raise UserError(
            f"contradicting {section}.{key}: --{section}.{key} {top_flags[key]!r} but "
            f"--{comp}.{section}.{key} {own_flags[key]!r} on the command line; set it once"
        )
    if per_run and comp in takers:
        own[key] = _per_run_value(key, value, comp, takers)
    elif key in top_flags or key in own_flags:  # the command line wins over the files
        own[key] = own_flags.get(key, top_flags.get(key))
    elif key in own and not _same(own[key], value) and not per_run:
        raise UserError(
            f"contradicting {section}.{key}: top level = {value!r} but {comp}.{section}.{key} = "
            f"{own[key]!r}; set it once"
        )


def _point_at_inference(raw: dict) -> None:
    """The orchestrator talks to the server rl starts (its port), unless told otherwise; that server's context
    is `seq_len` unless set."""
    if not isinstance(raw.get("inference"), dict):
        return
    client = dict(raw["orchestrator"].get("client") or {})
    port = loader.get_path(raw["inference"], ("server", "port"))
    if port is not None and "port" not in client and "base_url" not in client:
        client["port"] = port
    raw["orchestrator"]["client"] = client
    if (
        loader.get_path(raw, ("seq_len",)) is not None
        and loader.get_path(raw["inference"], ("model", "max_model_len")) is None
    ):
        loader.set_path(raw["inference"], ("model", "max_model_len"), raw["seq_len"])


def _record_routes_for_replay(raw: dict) -> None:
    """router_replay replays the routes the server records: rl's server records them unless told otherwise."""
    inference = raw.get("inference")
    replay = loader.get_path(raw["trainer"], ("model", "router_replay"))
    if isinstance(inference, dict) and replay and "enable_return_routed_experts" not in inference:
        inference["enable_return_routed_experts"] = True


def _dense(model: str) -> bool:
    """Whether `model` is a local checkpoint whose config.json names no experts (False when it cannot tell)."""
    return _experts(model) == 0


def _experts(model: str) -> int | None:
    """The experts per layer a local checkpoint's config.json names (0: dense), None when it cannot tell."""
    path = Path(model) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    return experts if isinstance(experts, int) else None


def _student_port(raw: dict) -> int:
    """The port of the server the student samples from: rl's [inference], else orchestrator.client's."""
    port = loader.get_path(raw.get("inference") or {}, ("server", "port"))
    port = port if port is not None else loader.get_path(raw["orchestrator"], ("client", "port"))
    return int(port) if port is not None else 8000


def wire_teacher(raw: dict) -> dict:
    """`[teacher]`: a second server rl starts (see the module docstring). Called after `propagate` and the
    exp_id dir, so it gets the run's final `output_dir`."""
    teacher = raw.get("teacher")
    if not isinstance(teacher, dict):
        return raw
    teacher = raw["teacher"] = copy.deepcopy(teacher)
    if loader.get_path(teacher, ("model", "name")) is None:
        raise UserError(
            '[teacher] starts a teacher server but names no model: set [teacher.model] name = "path/to/teacher" '
            "(--teacher.model.name)"
        )
    out = loader.get_path(raw["trainer"], ("output_dir",))
    if out is not None:  # its log and pid file go with the run's (unset: both take the same default)
        teacher["output_dir"] = str(out)
    if isinstance(raw["trainer"].get("log"), dict) and "log" not in teacher:
        teacher["log"] = dict(raw["trainer"]["log"])
    seq_len = loader.get_path(raw["orchestrator"], ("seq_len",))
    if seq_len is not None and loader.get_path(teacher, ("model", "max_model_len")) is None:
        # the scoring request generates one token after the sample: a full-length sample needs seq_len + 1
        loader.set_path(teacher, ("model", "max_model_len"), int(seq_len) + 1)
    if loader.get_path(teacher, ("server", "port")) is None:
        loader.set_path(teacher, ("server", "port"), _student_port(raw) + 1)
    elif isinstance(raw.get("inference"), dict) and str(teacher["server"]["port"]) == str(_student_port(raw)):
        # said here, before the orchestrator's own check (a teacher on the student's URL) words it for rl
        raise UserError(
            f"teacher.server.port ({teacher['server']['port']}) is the inference server's port; give the teacher "
            "its own (--teacher.server.port)"
        )
    client = dict(raw["orchestrator"].get("teacher") or {})
    if "base_url" not in client:  # the orchestrator scores with the server rl starts
        port = teacher["server"]["port"]
        if client.get("port") is not None and int(client["port"]) != int(port):
            raise UserError(
                f"contradicting teacher ports: [teacher.server] port = {port} but orchestrator.teacher.port = "
                f"{client['port']}; set the port of the teacher rl starts once ([teacher.server] port), or "
                "orchestrator.teacher.base_url for another server"
            )
        client["port"] = port
        host = loader.get_path(teacher, ("server", "host"))
        if host not in (None, "0.0.0.0", "::", ""):
            client["host"] = host
    raw["orchestrator"]["teacher"] = client
    return raw


def gpu_counts_to_ids(raw: dict) -> dict:
    """The older `--inference-gpus M --trainer-gpus N`: inference on GPUs 0..M-1, the trainer on the next N."""
    inference, trainer = raw.pop("inference_gpus", None), raw.pop("trainer_gpus", None)
    if inference is None and trainer is None:
        return raw
    if "inference_gpu_ids" in raw or "trainer_gpu_ids" in raw:
        raise UserError("set GPUs by count (--inference-gpus/--trainer-gpus) or by id (*_gpu_ids), not both")
    inference, trainer = _gpu_count("--inference-gpus", inference), _gpu_count("--trainer-gpus", trainer)
    ids = {"inference_gpu_ids": list(range(inference)), "trainer_gpu_ids": list(range(inference, inference + trainer))}
    loader.note_older_spelling(
        "--inference-gpus/--trainer-gpus",
        f"inference_gpu_ids = {ids['inference_gpu_ids']}, trainer_gpu_ids = {ids['trainer_gpu_ids']}",
    )
    return {**raw, **ids}


def _gpu_count(flag: str, value: object) -> int:
    """A GPU count as given (absent: 1); anything but a whole number >= 1 is the user's one-line error."""
    if value is None:
        return 1
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    if isinstance(value, str) and value.strip().isdigit() and int(value) >= 1:
        return int(value)
    raise UserError(f"{flag} takes a number of GPUs (1, 2, ...), got {value!r}; or set *_gpu_ids = [0, 1]")


def vllm_data_parallel(raw: dict) -> dict:
    """vLLM serves on every GPU of its server: data_parallel_size = len(inference_gpu_ids) / tensor_parallel_size
    unless set (the teacher: its teacher_gpu_ids, default the inference server's)."""
    for name in ("inference", "teacher"):
        server = raw.get(name)
        if not isinstance(server, dict) or "data_parallel_size" in server or chosen_backend(server) != "vllm":
            continue
        ids = raw.get(f"{name}_gpu_ids") or raw.get("inference_gpu_ids") or [0]
        gpus, tp = len(ids), int(server.get("tensor_parallel_size", 1))
        if gpus % tp:
            raise UserError(
                f"{gpus} {name} GPUs do not split into tensor-parallel groups of {tp}; "
                f"change {name}_gpu_ids or {name}.tensor_parallel_size"
            )
        raw = {**raw, name: {**server, "data_parallel_size": gpus // tp}}
    return raw


def resolve_rl(raw: dict, args: loader.ParsedArgs | None = None) -> RLConfig:
    raw = vllm_data_parallel(gpu_counts_to_ids(raw))
    if raw.get("bench"):
        raw = bench_job.apply_defaults(raw, SHARED)
    raw = propagate(raw, args.cli if args is not None else None)
    if raw.get("exp_id"):
        base = raw.get("output_dir") or loader.get_path(raw["trainer"], ("output_dir",)) or "outputs"
        out = str(Path(base) / raw["exp_id"])
        for comp in loader.COMPONENTS:
            if isinstance(raw.get(comp), dict):
                raw[comp]["output_dir"] = out
        raw["output_dir"] = out
    raw = wire_teacher(raw)
    config = loader.validate(RLConfig, raw)
    config.run_orchestrators()  # a run's bad orchestrator setting: one line now
    return config
