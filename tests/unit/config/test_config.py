"""Config system: PRIME-RL's precedence, CLI grammar, rl propagation, and one-line errors."""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
import typing
from pathlib import Path

import pytest

from asyncrl.config import loader, notes
from asyncrl.config.cli import parse_or_exit, to_toml
from asyncrl.config.eval import EvalConfig
from asyncrl.config.inference import InferenceConfig
from asyncrl.config.orchestrator import OrchestratorConfig
from asyncrl.config.rl import RLConfig, resolve_rl
from asyncrl.config.sft import SFTConfig
from asyncrl.config.synthesize import SynthesizeConfig
from asyncrl.config.trainer import TrainerConfig
from asyncrl.core.errors import UserError

REPO = Path(__file__).resolve().parents[3]
ENTRYPOINTS = ["rl", "trainer", "orchestrator", "inference", "sft", "eval", "synthesize"]
CONFIGS = [RLConfig, TrainerConfig, OrchestratorConfig, InferenceConfig, SFTConfig, EvalConfig, SynthesizeConfig]


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def rl(argv, environ=None):
    raw, args = loader.collect_raw(RLConfig, argv, environ or {})
    return resolve_rl(raw, args)


# ------------------------------------------------------------------ precedence (PRIME-RL's example)


@pytest.fixture
def qwen_files(tmp_path):
    return (
        write(tmp_path, "qwen8b.toml", '[model]\nname = "Qwen/Qwen3-8B"\n'),
        write(tmp_path, "qwen14b.toml", '[model]\nname = "Qwen/Qwen-14B"\n'),
    )


@pytest.mark.parametrize(
    "use_env, files, cli, expected",
    [
        (True, (0, 1), True, "Qwen/Qwen3-32B"),
        (True, (0, 1), False, "Qwen/Qwen-14B"),
        (True, (0,), False, "Qwen/Qwen3-8B"),
        (True, (), False, "Qwen/Qwen3-4B"),
        (False, (), False, "Qwen/Qwen3-0.6B"),
        (False, (1, 0), False, "Qwen/Qwen3-8B"),  # later file wins, whatever its name
        (True, (), True, "Qwen/Qwen3-32B"),
    ],
)
def test_precedence_matrix(qwen_files, use_env, files, cli, expected):
    env = {"PRIME_MODEL__NAME": "Qwen/Qwen3-4B"} if use_env else {}
    argv = []
    for i in files:
        argv += ["@", qwen_files[i]]
    if cli:
        argv += ["--model.name", "Qwen/Qwen3-32B"]
    assert loader.load_config(InferenceConfig, argv, env).model.name == expected


def test_cli_position_does_not_matter(qwen_files):
    argv = ["--model.name", "Qwen/Qwen3-32B", "@", qwen_files[0]]
    assert loader.load_config(InferenceConfig, argv, {}).model.name == "Qwen/Qwen3-32B"


def test_at_without_space_is_accepted(qwen_files):
    assert loader.load_config(InferenceConfig, [f"@{qwen_files[0]}"], {}).model.name == "Qwen/Qwen3-8B"


def test_prime_rl_precedence_command_end_to_end(qwen_files):
    """The exact command of the PRIME-RL docs, through the installed console script."""
    out = subprocess.run(
        [
            str(Path(sys.executable).parent / "inference"),
            "@",
            qwen_files[0],
            "@",
            qwen_files[1],
            "--model.name",
            "Qwen/Qwen3-32B",
            "--dry-run",
        ],
        env={"PRIME_MODEL__NAME": "Qwen/Qwen3-4B", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert tomllib.loads(out.stdout)["model"]["name"] == "Qwen/Qwen3-32B"


# ------------------------------------------------------------------ CLI grammar


def test_kebab_and_snake_and_equals():
    a = loader.load_config(OrchestratorConfig, ["--rollouts-per-example", "4", "--batch_size=8"], {})
    assert (a.batch_size, a.rollouts_per_example) == (8, 4)
    b = loader.load_config(OrchestratorConfig, ["--sampling.max-tokens", "64", "--sampling.top_p", "0.5"], {})
    assert (b.sampling.max_tokens, b.sampling.top_p) == (64, 0.5)


def test_booleans():
    assert loader.load_config(InferenceConfig, ["--model.enforce-eager"], {}).model.enforce_eager is True
    assert loader.load_config(InferenceConfig, ["--no-model.enforce-eager"], {}).model.enforce_eager is False
    assert loader.load_config(InferenceConfig, ["--model.enforce-eager", "false"], {}).model.enforce_eager is False
    cfg = rl(["--wandb", "--no-trainer.wandb.log-extras.distributions"])
    assert cfg.trainer.wandb.log_extras.distributions is False
    assert cfg.orchestrator.wandb.log_extras.distributions is True


def test_bare_section_flag_enables_with_defaults():
    assert loader.load_config(TrainerConfig, [], {}).ckpt is None  # off by default, as the PRIME-RL docs insist
    on = loader.load_config(TrainerConfig, ["--ckpt"], {})
    assert on.ckpt is not None and on.ckpt.interval == 50
    set_field = loader.load_config(TrainerConfig, ["--ckpt.interval", "10"], {})
    assert set_field.ckpt.interval == 10
    both = loader.load_config(TrainerConfig, ["--ckpt.interval", "10", "--ckpt"], {})
    assert both.ckpt.interval == 10
    assert loader.load_config(TrainerConfig, ["--ckpt", "--no-ckpt"], {}).ckpt is None


def test_lists_and_dicts_from_cli():
    cfg = rl(["--inference-gpu-ids", "0,1,2", "--trainer-gpu-ids", "[3]"])
    assert cfg.inference_gpu_ids == [0, 1, 2] and cfg.trainer_gpu_ids == [3]
    t = loader.load_config(
        TrainerConfig, ["--bench", "--data.fake", "{'micro_batch_size': 8, 'batch_size': 128, 'seq_len': 128}"], {}
    )
    assert t.data.fake.batch_size == 128 and t.bench
    e = loader.load_config(
        EvalConfig, ["--environment-ids", "math500,aime2025", "--steps", "10,50"] + ["--weights-dir", "w"], {}
    )
    assert e.environment_ids == ["math500", "aime2025"] and e.steps == [10, 50]


@pytest.mark.parametrize("form", ["dict", "flag", "file", "env"])
def test_fake_micro_batch_size_is_the_older_spelling_of_samples_per_row(form, tmp_path, capsys, monkeypatch):
    """PRIME-RL's `--data.fake "{'micro_batch_size': 8, ...}"` (samples packed per row, not rows per forward:
    that is data.micro_batch_size) still works in every source, with one note naming samples_per_row."""
    monkeypatch.setattr(notes, "_noted", set())
    argv, env = {
        "dict": (["--data.fake", "{'micro_batch_size': 4, 'batch_size': 8, 'seq_len': 16}"], {}),
        "flag": (["--data.fake.micro-batch-size", "4", "--data.fake.batch-size", "8"], {}),
        "file": (["@", write(tmp_path, "t.toml", "[data.fake]\nmicro_batch_size = 4\nbatch_size = 8\n")], {}),
        "env": (["--data.fake.batch-size", "8"], {"PRIME_DATA__FAKE__MICRO_BATCH_SIZE": "4"}),
    }[form]
    t = loader.load_config(TrainerConfig, argv, env)
    assert t.data.fake.samples_per_row == 4 and t.data.micro_batch_size == 16  # rows per forward: untouched
    assert "micro_batch_size" not in t.data.fake.model_dump()  # dumped (and --dry-run) as samples_per_row
    assert capsys.readouterr().err.splitlines() == [
        "note: data.fake.micro_batch_size is the older spelling of data.fake.samples_per_row"
    ]
    with pytest.raises(UserError, match="older spelling of samples_per_row"):
        loader.load_config(TrainerConfig, ["--data.fake", "{'micro_batch_size': 4, 'samples_per_row': 4}"], {})


def test_trainer_seq_len_is_checked_where_given():
    """trainer.data.seq_len: unset on its own (no check), rl gives it the orchestrator's seq_len."""
    assert loader.load_config(TrainerConfig, [], {}).data.seq_len is None
    assert loader.load_config(TrainerConfig, ["--data.seq-len", "512"], {}).data.seq_len == 512
    cfg = rl(["--seq-len", "512"])
    assert cfg.trainer.data.seq_len == cfg.orchestrator.seq_len == 512
    cfg = rl([])  # not given: the rows the orchestrator packs, at its default
    assert cfg.trainer.data.seq_len == cfg.orchestrator.seq_len == 2048


def test_env_values_are_parsed_and_nested():
    cfg = loader.load_config(OrchestratorConfig, [], {"PRIME_SAMPLING__MAX_TOKENS": "32", "PRIME_BATCH_SIZE": "16"})
    assert cfg.sampling.max_tokens == 32 and cfg.batch_size == 16
    assert loader.load_config(TrainerConfig, [], {"PRIME_CKPT__INTERVAL": "7"}).ckpt.interval == 7


def test_kebab_keys_in_files(tmp_path):
    f = write(tmp_path, "o.toml", "batch-size = 16\nrollouts-per-example = 4\n[sampling]\nmax-tokens = 8\n")
    cfg = loader.load_config(OrchestratorConfig, ["@", f], {})
    assert (cfg.batch_size, cfg.sampling.max_tokens) == (16, 8)


def test_env_args_keys_are_not_rewritten(tmp_path):
    f = write(tmp_path, "o.toml", '[[env]]\nid = "x"\nargs = { "my-key" = 1 }\n')
    assert loader.load_config(OrchestratorConfig, ["@", f], {}).env[0].args == {"my-key": 1}


def test_inference_max_model_len_alias():
    assert loader.load_config(InferenceConfig, ["--max-model-len", "2048"], {}).model.max_model_len == 2048


# ------------------------------------------------------------------ rl: component files, combined file, propagation


def test_rl_component_files_and_shared_propagation(tmp_path):
    t = write(tmp_path, "t.toml", "[optim]\nlr = 3e-5\n")
    o = write(tmp_path, "o.toml", "batch_size = 16\nrollouts_per_example = 4\n")
    i = write(tmp_path, "i.toml", "[server]\nport = 8011\n")
    cfg = rl(
        [
            "--trainer",
            "@",
            t,
            "--orchestrator",
            "@",
            o,
            "--inference",
            "@",
            i,
            "--model.name",
            "m",
            "--max-steps",
            "5",
            "--seq-len",
            "256",
            "--max-async-level",
            "1",
            "--output-dir",
            "out/x",
        ]
    )
    assert cfg.trainer.optim.lr == 3e-5 and cfg.orchestrator.batch_size == 16
    for comp in (cfg.trainer, cfg.orchestrator, cfg.inference):
        assert comp.model.name == "m" and str(comp.output_dir) == "out/x"
    assert cfg.trainer.max_steps == cfg.orchestrator.max_steps == 5
    assert cfg.trainer.data.seq_len == cfg.orchestrator.seq_len == 256
    assert cfg.inference.model.max_model_len == 256
    assert cfg.trainer.max_async_level == cfg.orchestrator.max_async_level == 1
    assert cfg.orchestrator.client.port == 8011  # follows the server rl starts


def test_rl_combined_file(tmp_path):
    f = write(
        tmp_path,
        "rl.toml",
        'max_steps = 3\n[model]\nname = "m"\n[wandb]\nproject = "p"\nname = "run"\n'
        "[ckpt]\ninterval = 2\n[trainer.optim]\nlr = 1e-4\n[orchestrator]\nbatch_size = 8\n"
        "rollouts_per_example = 2\n[inference]\n",
    )
    cfg = rl(["@", f])
    assert cfg.trainer.wandb.name == "run-trainer" and cfg.orchestrator.wandb.name == "run-orchestrator"
    assert cfg.trainer.ckpt.interval == cfg.orchestrator.ckpt.interval == 2
    assert cfg.inference is not None and cfg.inference.model.name == "m"
    assert cfg.trainer.optim.lr == 1e-4


def test_rl_value_set_in_one_component_reaches_the_others(tmp_path):
    t = write(tmp_path, "t.toml", '[model]\nname = "m"\n')
    cfg = rl(["--trainer", "@", t])
    assert cfg.orchestrator.model.name == "m"


def test_rl_contradicting_model_names(tmp_path):
    t = write(tmp_path, "t.toml", '[model]\nname = "a"\n')
    o = write(tmp_path, "o.toml", '[model]\nname = "b"\n')
    with pytest.raises(UserError, match="contradicting model.name"):
        rl(["--trainer", "@", t, "--orchestrator", "@", o])
    with pytest.raises(UserError, match="contradicting max_steps"):
        rl(["--max-steps", "5", "--trainer.max-steps", "6"])
    with pytest.raises(UserError, match="contradicting ckpt.interval"):
        rl(["--ckpt.interval", "5", "--trainer.ckpt.interval", "6"])


def test_rl_command_line_wins_over_component_files(tmp_path):
    """PRIME-RL's split-run recipe, verbatim, with component files that set max_steps (as PRIME-RL's files do)."""
    t = write(tmp_path, "train.toml", 'max_steps = 20\n[model]\nname = "m"\n[ckpt]\ninterval = 50\n')
    o = write(tmp_path, "orch.toml", "max_steps = 20\nbatch_size = 8\nrollouts_per_example = 2\n")
    run1 = rl(["--trainer", "@", t, "--orchestrator", "@", o, "--max-steps", "10", "--ckpt"])
    assert run1.trainer.max_steps == run1.orchestrator.max_steps == 10
    run2 = rl(["--trainer", "@", t, "--orchestrator", "@", o, "--max-steps", "20", "--ckpt.resume-step", "10"])
    assert run2.trainer.max_steps == run2.orchestrator.max_steps == 20
    assert run2.trainer.ckpt.resume_step == run2.orchestrator.ckpt.resume_step == 10
    # a flag in one component also wins over the files, and reaches the other components
    cfg = rl(["--trainer", "@", t, "--orchestrator", "@", o, "--orchestrator.max-steps", "7"])
    assert cfg.trainer.max_steps == cfg.orchestrator.max_steps == 7
    # shared sections too: --ckpt.interval beats the trainer file's [ckpt] interval
    assert rl(["--trainer", "@", t, "--ckpt.interval", "5"]).trainer.ckpt.interval == 5
    # two files that disagree stay a contradiction (which one is meant is unknowable)
    o2 = write(tmp_path, "orch2.toml", "max_steps = 30\nbatch_size = 8\nrollouts_per_example = 2\n")
    with pytest.raises(UserError, match=r"contradicting max_steps: .* \(in the config files\)"):
        rl(["--trainer", "@", t, "--orchestrator", "@", o2])


def test_rl_trainer_resume_implies_orchestrator_resume():
    cfg = rl(["--trainer.ckpt.resume-step", "50"])
    assert cfg.orchestrator.ckpt.resume_step == 50
    cfg = rl(["--ckpt.resume-step", "10", "--max-steps", "20"])
    assert cfg.trainer.ckpt.resume_step == cfg.orchestrator.ckpt.resume_step == 10


def test_rl_exp_id_separates_output_dirs():
    cfg = rl(["--exp-id", "exp-2", "--inference"])
    assert str(cfg.trainer.output_dir) == str(cfg.orchestrator.output_dir) == "outputs/exp-2"


@pytest.mark.parametrize(
    "example", sorted((REPO / "examples").rglob("*.toml")), ids=lambda p: str(p.relative_to(REPO / "examples"))
)
def test_examples_resolve(example):
    text = example.read_text()
    if "[trainer" in text or "[orchestrator" in text or "inference_gpu_ids" in text:
        rl(["@", str(example)])
    else:  # a component file: it must resolve as the component its name says
        comp = {"sft": SFTConfig, "train": TrainerConfig, "orch": OrchestratorConfig, "infer": InferenceConfig}
        model = next((m for k, m in comp.items() if k in example.stem), None)
        assert model is not None, f"{example}: name it after its entrypoint (sft, trainer, orchestrator, inference)"
        loader.load_config(model, ["@", str(example)], {})


# ------------------------------------------------------------------ errors: one line, names the key, says the fix


@pytest.mark.parametrize(
    "model, argv, env, message",
    [
        (InferenceConfig, ["--model.nmae", "x"], {}, "did you mean 'model.name'"),
        (TrainerConfig, ["--optim.lrr", "1"], {}, "did you mean 'optim.lr'"),
        (TrainerConfig, ["--optim.lr", "fast"], {}, "optim.lr"),
        (TrainerConfig, ["--max-steps", "-3"], {}, "max_steps"),
        (TrainerConfig, [], {"PRIME_OPTIM__LRR": "1"}, "PRIME_OPTIM__LRR"),
        (OrchestratorConfig, ["--batch-size", "10", "--rollouts-per-example", "3"], {}, "divisible"),
        (OrchestratorConfig, ["--sampling.max-tokens", "4096", "--seq-len", "2048"], {}, "cannot fit in seq_len"),
        (OrchestratorConfig, ["--sampling.temperature", "0"], {}, "use a temperature > 0"),
        (TrainerConfig, ["@", "/nonexistent/t.toml"], {}, "not found: /nonexistent/t.toml"),
        (TrainerConfig, ["--optim.lr"], {}, "--optim.lr needs a value"),
        (TrainerConfig, ["stray"], {}, "unexpected argument"),
        (InferenceConfig, ["--model.enable-auto-tool-choice"], {}, "tool_call_parser"),
        (EvalConfig, [], {}, "--environment-ids"),
        (SFTConfig, ["--data.type", "dataset"], {}, "data.name"),
    ],
)
def test_user_errors(model, argv, env, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(".", r"\.").replace("'", "'")):
        raw, _ = loader.collect_raw(model, argv, env)
        loader.validate(model, raw)


def test_file_errors_name_file_and_line(tmp_path):
    bad = write(tmp_path, "bad.toml", 'a = 1\n[model\nname = "x"\n')
    with pytest.raises(UserError, match=r"bad\.toml.*line 2"):
        loader.load_config(TrainerConfig, ["@", bad], {})
    unknown = write(tmp_path, "u.toml", "[optim]\nlrr = 1\n")
    with pytest.raises(UserError, match=r"u\.toml: unknown key 'optim\.lrr'; did you mean 'optim\.lr'"):
        loader.load_config(TrainerConfig, ["@", unknown], {})
    scoped = write(tmp_path, "t.toml", "[optim]\nlrr = 1\n")
    with pytest.raises(UserError, match=r"unknown key 'trainer\.optim\.lrr'; did you mean 'trainer\.optim\.lr'"):
        rl(["--trainer", "@", scoped])
    ac_string = write(tmp_path, "ac.toml", '[model]\nac = "full"\n')
    with pytest.raises(UserError, match=r"'model\.ac' is a section"):
        loader.load_config(TrainerConfig, ["@", ac_string], {})


def test_cli_errors_exit_2_with_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_or_exit(TrainerConfig, "trainer", "", ["--optim.lrr", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown option --optim.lrr") and err.count("\n") == 1


def test_bad_input_via_console_script_has_no_traceback(tmp_path):
    bad = write(tmp_path, "o.toml", "batch_size = 10\nrollouts_per_example = 3\n")
    out = subprocess.run(
        [str(Path(sys.executable).parent / "rl"), "--orchestrator", "@", bad], capture_output=True, text=True
    )
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and "divisible by rollouts_per_example" in out.stderr


# ------------------------------------------------------------------ --help and --dry-run of all seven entrypoints


@pytest.mark.parametrize("name", ENTRYPOINTS)
def test_help_lists_every_option_with_default(name, capsys):
    module = importlib.import_module(f"asyncrl.entrypoints.{name}")
    with pytest.raises(SystemExit) as exc:
        module.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    model = CONFIGS[ENTRYPOINTS.index(name)]
    for key in loader.all_keys(model):
        assert "--" + key.replace("_", "-") in out, key
    assert "(default:" in out and "--dry-run" in out


@pytest.mark.parametrize("name", ENTRYPOINTS)
def test_dry_run_prints_loadable_toml(name, capsys, tmp_path):
    model = CONFIGS[ENTRYPOINTS.index(name)]
    extra = ["--environment-ids", "reverse-text"] if name in ("eval", "synthesize") else []
    module = importlib.import_module(f"asyncrl.entrypoints.{name}")
    with pytest.raises(SystemExit) as exc:
        module.main(["--dry-run", *extra])
    assert exc.value.code == 0
    dumped = capsys.readouterr().out
    path = write(tmp_path, "dumped.toml", dumped)
    again = rl(["@", path]) if name == "rl" else loader.load_config(model, ["@", path], {})
    assert to_toml(again) == dumped  # the dump is the whole config: it round-trips


@pytest.mark.parametrize("model", CONFIGS, ids=lambda m: m.__name__)
def test_optional_fields_default_to_none(model):
    """TOML has no null: dumps drop None, so a None must always mean 'the default'."""

    def walk(m):
        for name, f in m.model_fields.items():
            inner, optional = loader._unwrap(f.annotation)
            if optional:
                assert f.default is None, f"{m.__name__}.{name}"
            if loader._is_model(inner):
                walk(inner)
            for arg in typing.get_args(inner):
                if loader._is_model(arg):
                    walk(arg)

    walk(model)


def test_share_prefix_is_on_unless_turned_off():
    assert loader.load_config(OrchestratorConfig, [], {}).share_prefix is True
    assert loader.load_config(OrchestratorConfig, ["--no-share-prefix"], {}).share_prefix is False
    assert rl([]).orchestrator.share_prefix is True
    assert rl(["--no-orchestrator.share-prefix"]).orchestrator.share_prefix is False


@pytest.mark.parametrize(
    ("argv", "trainer_on", "distributions"),
    [
        (["--no-trainer.wandb.log-extras.distributions"], False, None),  # settings alone: W&B stays off
        (["--wandb", "--no-trainer.wandb.log-extras.distributions"], True, False),
        (["--trainer.wandb", "--trainer.wandb.log-extras.interval", "5"], True, True),
        (["--trainer.wandb.project", "p", "--no-trainer.wandb.log-extras.distributions"], True, False),
    ],
)
def test_wandb_extras_settings_alone_do_not_switch_wandb_on(argv, trainer_on, distributions):
    from asyncrl.config.rl import RLConfig, resolve_rl

    raw, args = loader.collect_raw(RLConfig, argv, {})
    wandb = resolve_rl(raw, args).trainer.wandb
    assert (wandb is not None) == trainer_on
    assert wandb is None or wandb.log_extras.distributions == distributions


def test_an_empty_wandb_table_or_env_switches_it_on(tmp_path):
    from asyncrl.config.trainer import TrainerConfig

    (tmp_path / "t.toml").write_text("[wandb]\n")
    assert loader.load_config(TrainerConfig, ["@", str(tmp_path / "t.toml")], {}).wandb is not None
    assert loader.load_config(TrainerConfig, [], {"PRIME_WANDB": ""}).wandb is not None
    extras_only = tmp_path / "x.toml"
    extras_only.write_text("[wandb.log_extras]\ninterval = 3\n")
    assert loader.load_config(TrainerConfig, ["@", str(extras_only)], {}).wandb is None
    assert loader.load_config(TrainerConfig, ["@", str(extras_only), "--wandb"], {}).wandb.log_extras.interval == 3
