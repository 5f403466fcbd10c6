"""Before/after harness of the config command line: ~2,400 argv/@file/env cases over every entrypoint config.

Each case runs through `cli.parse_or_exit` (what the entrypoints call) and records what a user sees: the
resolved config (as the keys that differ from that entrypoint's defaults), or the exit status and the
stderr lines (the one-line error, the older-spelling notes). `tests/unit/config/data/config_harness.jsonl` holds
the results of the loader as it was before it was split; any change in behaviour fails here, case by case.

Record anew (only when a behaviour change is intended): `python tests/unit/config/test_harness.py --record`.
The cases come from walking each model's pydantic fields, not from the loader, so a loader change cannot
change what is asked.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
import tempfile
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from asyncrl.config import cli, loader
from asyncrl.config.env_server import EnvServerConfig
from asyncrl.config.eval import EvalConfig
from asyncrl.config.inference import InferenceConfig
from asyncrl.config.orchestrator import OrchestratorConfig
from asyncrl.config.rl import RLConfig, resolve_rl
from asyncrl.config.sft import SFTConfig
from asyncrl.config.synthesize import SynthesizeConfig
from asyncrl.config.trainer import TrainerConfig

GOLDEN = Path(__file__).parent / "data" / "config_harness.jsonl"
ENTRIES: dict[str, tuple[type[BaseModel], dict]] = {
    "rl": (RLConfig, {"resolve": resolve_rl}),
    "trainer": (TrainerConfig, {}),
    "orchestrator": (OrchestratorConfig, {}),
    "inference": (InferenceConfig, {"passthrough": True}),
    "sft": (SFTConfig, {}),
    "eval": (EvalConfig, {}),
    "synthesize": (SynthesizeConfig, {}),
    "env-server": (EnvServerConfig, {}),
}
BASE_ENV = {"eval": {"PRIME_ENVIRONMENT_IDS": "reverse-text"}, "synthesize": {"PRIME_ENVIRONMENT_IDS": "reverse-text"}}


# ---------------------------------------------------------------- walking the models (pydantic only)


def _inner(annotation: Any) -> tuple[Any, bool]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return (args[0] if len(args) == 1 else annotation), len(args) < len(typing.get_args(annotation))
    return annotation, False


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def walk(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any, bool]]:
    """(path, type, optional) of every field, sections included, depth-first."""
    out = []
    for name, f in model.model_fields.items():
        tp, optional = _inner(f.annotation)
        out.append(((*prefix, name), tp, optional))
        if _is_model(tp):
            out += walk(tp, (*prefix, name))
    return out


def sample(tp: Any) -> str:
    """A plausible CLI value for a field of type `tp` (validity is not required: errors are recorded too)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return str(args[-1])
    if origin is list and args and _is_model(args[0]):
        return '[{"id": "reverse-text"}]'
    if origin is list and args and args[0] is int:
        return "1,2"
    if origin is list or tp is list:
        return "a,b"
    if origin is dict or tp is dict:
        return '{"k": 1}'
    return {bool: "true", int: "3", float: "0.5", str: "abc", Path: "some/dir"}.get(tp, "x")


def toml_value(tp: Any) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return args[-1]
    if origin is list:
        return (
            [{"id": "reverse-text"}] if args and _is_model(args[0]) else ([1, 2] if args and args[0] is int else ["a"])
        )
    if origin is dict:
        return {"k": 1}
    return {bool: False, int: 4, float: 0.25, str: "xyz", Path: "p/q"}.get(tp, "x")


def kebab(path: tuple[str, ...]) -> str:
    return ".".join(p.replace("_", "-") for p in path)


def dotted(path: tuple[str, ...]) -> str:
    return ".".join(path)


def env_name(path: tuple[str, ...]) -> str:
    return "PRIME_" + "__".join(p.upper() for p in path)


# ---------------------------------------------------------------- the cases


def _case(entry: str, name: str, argv: list[str], env: dict | None = None, files: dict | None = None) -> dict:
    return {"id": f"{entry}: {name}", "entry": entry, "argv": argv, "env": env or {}, "files": files or {}}


def field_cases(entry: str, model: type[BaseModel]) -> list[dict]:
    out = []
    for i, (path, tp, optional) in enumerate(walk(model)):
        key, keb = dotted(path), kebab(path)
        if _is_model(tp):
            out.append(_case(entry, f"--{keb} (bare section)", [f"--{keb}"]))
            if optional:
                out.append(_case(entry, f"--no-{keb}", [f"--no-{keb}"]))
            continue
        if tp is bool:
            out.append(_case(entry, f"--{key}", [f"--{key}"]))
            out.append(_case(entry, f"--no-{keb}", [f"--no-{keb}"]))
            out.append(_case(entry, f"--{keb} false", [f"--{keb}", "false"]))
            out.append(_case(entry, f"--{keb}=maybe", [f"--{keb}=maybe"]))
            continue
        value = sample(tp)
        out.append(_case(entry, f"--{key} {value}", [f"--{key}", value]))
        out.append(_case(entry, f"--{keb}={value}", [f"--{keb}={value}"]))
        if tp in (int, float) or typing.get_origin(tp) is typing.Literal:
            out.append(_case(entry, f"--{keb} bad type", [f"--{keb}", "not-a-number"]))
        if typing.get_origin(tp) is list and not _is_model((typing.get_args(tp) or [None])[0]):
            out.append(_case(entry, f"--{keb} JSON list", [f"--{keb}", json.dumps(toml_value(tp))]))
        if optional:
            out.append(_case(entry, f"--{keb} none", [f"--{keb}", "none"]))
        if i % 4 == 0:
            out.append(_case(entry, f"--{keb} missing value", [f"--{keb}"]))
        if i % 5 == 0:
            out.append(_case(entry, f"env {env_name(path)}", [], {env_name(path): value}))
    return out


def file_cases(entry: str, model: type[BaseModel]) -> list[dict]:
    fields = walk(model)
    leaves = [(p, tp) for p, tp, _ in fields if not _is_model(tp)]
    sections = [(p, tp) for p, tp, _ in fields if _is_model(tp)]

    def nested(items: list[tuple[tuple[str, ...], Any]], spell=lambda p: p) -> dict:
        tree: dict = {}
        for path, tp in items:
            node = tree
            for part in path[:-1]:
                node = node.setdefault(spell(part), {})
            node[spell(path[-1])] = toml_value(tp)
        return tree

    out = []
    for n in range(0, len(leaves), 6):  # a whole-config file with nested tables, a handful of keys each
        chunk = leaves[n : n + 6]
        out.append(
            _case(entry, f"@ file keys {n}-{n + len(chunk)}", ["@", "{a.toml}"], files={"a.toml": nested(chunk)})
        )
    kebab_tree = nested(leaves[:8], lambda p: p.replace("_", "-"))
    out.append(_case(entry, "@file kebab keys", ["@{k.toml}"], files={"k.toml": kebab_tree}))
    out.append(_case(entry, "@ json file", ["@", "{j.json}"], files={"j.json": nested(leaves[:5])}))
    two = [nested(leaves[:1]), nested(leaves[1:2])]
    out.append(
        _case(
            entry,
            "two @ files, later wins",
            ["@", "{a.toml}", "@", "{b.toml}"],
            files={"a.toml": two[0], "b.toml": two[1]},
        )
    )
    path, tp = leaves[0]
    flag = [f"--{kebab(path)}", sample(tp)]
    out.append(
        _case(entry, "CLI before @ file still wins", [*flag, "@", "{a.toml}"], files={"a.toml": nested([leaves[0]])})
    )
    out.append(
        _case(
            entry, "@ file over env", ["@", "{a.toml}"], {env_name(path): sample(tp)}, {"a.toml": nested([leaves[0]])}
        )
    )
    for spath, _ in sections[:6]:
        sub = [(p[len(spath) :], t) for p, t in leaves if p[: len(spath)] == spath][:4]
        if sub:
            files = {"s.toml": nested(sub)}
            out.append(_case(entry, f"--{kebab(spath)} @ s.toml", [f"--{kebab(spath)}", "@", "{s.toml}"], files=files))
            out.append(_case(entry, f"--{kebab(spath)} @s.toml", [f"--{kebab(spath)}", "@{s.toml}"], files=files))
            out.append(_case(entry, f"--{kebab(spath)}=@s.toml", [f"--{kebab(spath)}=@{{s.toml}}"], files=files))
        out.append(
            _case(
                entry, f"{dotted(spath)} = scalar in file", ["@", "{a.toml}"], files={"a.toml": nested([(spath, int)])}
            )
        )
    out += [
        _case(entry, "@ unknown key", ["@", "{a.toml}"], files={"a.toml": {"not_a_key": 1}}),
        _case(entry, "@ unknown nested key", ["@", "{a.toml}"], files={"a.toml": {leaves[-1][0][0]: {"nope": 1}}}),
        _case(entry, "@ bad toml", ["@", "{bad.toml}"], files={"bad.toml": "x = = 1"}),
        _case(entry, "@ bad json", ["@", "{bad.json}"], files={"bad.json": "{nope"}),
        _case(entry, "@ missing file", ["@", "{missing.toml}"]),
        _case(entry, "@ directory", ["@", "{dir}"], files={"dir/x.toml": {}}),
        _case(entry, "@ with no path", ["@"]),
        _case(entry, "@ top level not a table", ["@", "{j.json}"], files={"j.json": "[1, 2]"}),
    ]
    return out


def grammar_cases(entry: str, model: type[BaseModel]) -> list[dict]:
    leaves = [(p, tp) for p, tp, _ in walk(model) if not _is_model(tp)]
    (p0, t0), (p1, t1) = leaves[0], leaves[1]
    return [
        _case(entry, "no arguments", []),
        _case(entry, "--dry-run", ["--dry-run"]),
        _case(entry, "--dry-run with a value", ["--dry-run", f"--{kebab(p0)}", sample(t0)]),
        _case(entry, "unknown flag", ["--not-an-option", "1"]),
        _case(entry, "typo flag", [f"--{kebab(p1)}x", sample(t1)]),
        _case(entry, "unknown nested", ["--model.nonexistent", "1"]),
        _case(entry, "positional", ["stray"]),
        _case(entry, "single dash", ["-x"]),
        _case(entry, "--no- on a value option", [f"--no-{kebab(p1)}"] if t1 is not bool else ["--no-output-dir"]),
        _case(entry, "last flag wins", [f"--{kebab(p0)}", sample(t0), f"--{dotted(p0)}", sample(t0)]),
        _case(entry, "env unknown", [], {"PRIME_NOT_AN_OPTION": "1"}),
        _case(entry, "env lowercase nesting", [], {"PRIME_LOG__LEVEL": "debug"}),
        _case(entry, "env + cli", [f"--{kebab(p0)}", sample(t0)], {env_name(p0): sample(t0)}),
        _case(entry, "trainer cp (not here)", ["--trainer.model.cp", "2"]),
        _case(entry, "model cp (not here)", ["--model.cp", "2"]),
        _case(entry, "other component's option", ["--orchestrator.sampling.max-tokens", "8"]),
        _case(entry, "other component's flag", ["--trainer.model.ac"]),
        _case(entry, "other component unknown", ["--inference.nope", "1"]),
        _case(entry, "older monitor.wandb", ["--monitor.wandb.project", "p"]),
        _case(entry, "older monitor.wandb bare", ["--monitor.wandb"]),
        _case(entry, "wandb bare", ["--wandb"]),
        _case(entry, "wandb setting", ["--wandb.project", "p"]),
        _case(entry, "wandb extras only", ["--wandb.log-extras.interval", "3"]),
        _case(entry, "wandb extras + bare", ["--wandb.log-extras.interval", "3", "--wandb"]),
        _case(
            entry, "wandb extras file", ["@", "{a.toml}"], files={"a.toml": {"wandb": {"log_extras": {"interval": 2}}}}
        ),
        _case(entry, "wandb empty table", ["@", "{a.toml}"], files={"a.toml": {"wandb": {}}}),
        _case(entry, "env wandb bare", [], {"PRIME_WANDB": ""}),
        _case(entry, "no-wandb after wandb", ["--wandb", "--no-wandb"]),
        _case(entry, "ckpt then value", ["--ckpt", "--ckpt.interval", "5"]),
        _case(entry, "ckpt value then bare", ["--ckpt.interval", "5", "--ckpt"]),
        _case(entry, "ckpt dict", ["--ckpt", '{"interval": 6}']),
        _case(entry, "ckpt=dict python", ["--ckpt={'interval': 7}"]),
        _case(entry, "ckpt bad dict", ["--ckpt=[1]"]),
        _case(entry, "ckpt @ missing path", ["--ckpt", "@"]),
        _case(entry, "log level", ["--log.level", "debug"]),
        _case(entry, "log level bad", ["--log.level", "loud"]),
        _case(entry, "help is not parsed", ["--bogus", "--dry-run"]),
    ]


def special_cases() -> list[dict]:
    rl = [
        ["--model.name", "m"],
        ["--max-steps", "7"],
        ["--seq-len", "256"],
        ["--seq_len", "256", "--inference.model.max-model-len", "512"],
        ["--max-async-level", "3"],
        ["--output-dir", "o"],
        ["--output-dir", "o", "--exp-id", "e1"],
        ["--model.name", "a", "--trainer.model.name", "b"],
        ["--max-steps", "5", "--orchestrator.max-steps", "5"],
        ["--max-steps", "5", "--orchestrator.max-steps", "6"],
        ["--wandb.project", "p", "--wandb.name", "n"],
        ["--wandb.project", "p", "--trainer.wandb.project", "q"],
        ["--wandb.name", "n", "--trainer.wandb.name", "t"],
        ["--ckpt", "--ckpt.interval", "4"],
        ["--trainer.ckpt.resume-step", "3"],
        ["--log.level", "debug"],
        ["--inference.server.port", "9001"],
        ["--inference.server.port", "9001", "--orchestrator.client.port", "9002"],
        ["--inference-gpus", "2", "--trainer-gpus", "1"],
        ["--inference-gpus", "2", "--inference-gpu-ids", "0"],
        ["--inference.backend", "vllm", "--inference-gpu-ids", "[0,1]"],
        ["--inference.backend", "vllm", "--inference-gpu-ids", "[0,1,2]", "--inference.tensor-parallel-size", "2"],
        ["--bench"],
        ["--bench", "--max-steps", "3"],
        ["--trainer.monitor.wandb.project", "p"],
        ["--orchestrator.monitor.wandb.id", "x"],
        ["--no-inference"],
        ["--inference"],
        ["--trainer", "@", "{t.toml}", "--orchestrator", "@", "{o.toml}"],
        ["@", "{rl.toml}"],
        ["@", "{rl.toml}", "--max-steps", "9"],
        ["@", "{rl.toml}", "@", "{rl2.toml}"],
    ]
    files = {
        "t.toml": {"max_steps": 5, "optim": {"lr": 0.001}},
        "o.toml": {"max_steps": 5, "sampling": {"max_tokens": 16}},
        "rl.toml": {
            "max_steps": 4,
            "model": {"name": "m"},
            "trainer": {"optim": {"lr": 0.01}},
            "wandb": {"project": "w"},
        },
        "rl2.toml": {"max_steps": 6, "orchestrator": {"batch_size": 8}},
    }
    out = [_case("rl", "propagate " + " ".join(a), a, files=files) for a in rl]
    out += [
        _case(
            "rl",
            "runs file",
            ["@", "{runs.toml}"],
            files={"runs.toml": {"runs": [{"name": "a", "lr": 0.01}, {"name": "b"}]}},
        ),
        _case("rl", "runs bad name", ["@", "{runs.toml}"], files={"runs.toml": {"runs": [{"name": "a b"}]}}),
        _case("rl", "env propagate", [], {"PRIME_MAX_STEPS": "11", "PRIME_MODEL__NAME": "envm"}),
        _case("inference", "max-model-len alias", ["--max-model-len", "2048"]),
        _case("inference", "max_model_len alias", ["--max_model_len=1024"]),
        _case("inference", "passthrough, no vllm", ["--enable-prefix-caching"]),
        _case("inference", "passthrough vllm", ["--backend", "vllm", "--enable-prefix-caching", "--swap-space", "4"]),
        _case("inference", "passthrough vllm =", ["--backend", "vllm", "--gpu-memory-utilization=0.5"]),
        _case("inference", "passthrough then flag", ["--backend", "vllm", "--foo", "--model.name", "m"]),
        _case("eval", "env.id alias", ["--env.id", "math500"]),
        _case("eval", "benchmarks alias", ["--benchmarks", "math500,aime24,aime25"]),
        _case("eval", "benchmarks json", ["--benchmarks", '["aime24"]']),
        _case("sft", "data fake dict", ["--data.fake", "{'seq_len': 8}"]),
        _case("trainer", "data fake dict", ["--data.fake", '{"seq_len": 8, "batch_size": 4, "micro_batch_size": 2}']),
        _case("trainer", "data fake bare", ["--data.fake"]),
        _case("trainer", "ac string in file", ["@", "{a.toml}"], files={"a.toml": {"model": {"ac": "full"}}}),
        _case(
            "orchestrator",
            "env list file",
            ["@", "{a.toml}"],
            files={"a.toml": {"env": [{"id": "x", "args": {"my-key": 1}}]}},
        ),
        _case(
            "orchestrator",
            "env list kebab in item",
            ["@", "{a.toml}"],
            files={"a.toml": {"env": [{"id": "x", "bad-key": 1}]}},
        ),
    ]
    return out


def all_cases() -> list[dict]:
    cases = []
    for entry, (model, _) in ENTRIES.items():
        cases += field_cases(entry, model) + file_cases(entry, model) + grammar_cases(entry, model)
    cases += special_cases()
    seen: dict[str, int] = {}
    for c in cases:  # ids are unique keys of the golden file
        n = seen[c["id"]] = seen.get(c["id"], 0) + 1
        if n > 1:
            c["id"] += f" #{n}"
    return cases


# ---------------------------------------------------------------- running one case


def _write(tmp: Path, name: str, content: Any) -> None:
    p = tmp / name
    p.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, str):
        p.write_text(content)
    elif name.endswith(".json"):
        p.write_text(json.dumps(content))
    else:
        import tomli_w

        p.write_text(tomli_w.dumps(content))


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict) and tree:
        out = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else k))
        return out
    return {prefix: tree}


@contextlib.contextmanager
def _environment(env: dict):
    saved = {k: v for k, v in os.environ.items() if k.startswith("PRIME_")}
    for k in saved:
        del os.environ[k]
    os.environ.update(env)
    try:
        yield
    finally:
        for k in [k for k in os.environ if k.startswith("PRIME_")]:
            del os.environ[k]
        os.environ.update(saved)


def run_case(case: dict, tmp: Path, defaults: dict[str, dict] | None = None, parse=None) -> dict:
    """What the user sees: {"exit": code, "stderr": [...], "stdout"?, "set": {dotted: value}}."""
    model, kwargs = ENTRIES[case["entry"]]
    work = tmp / str(abs(hash(case["id"])))
    for name, content in case["files"].items():
        _write(work, name, content)
    argv = [re.sub(r"\{([\w./-]+)\}", lambda m: f"{work}/{m[1]}", a) for a in case["argv"]]  # {name}: a file
    loader._noted.clear()
    err, out = io.StringIO(), io.StringIO()
    result: dict = {}
    with (
        _environment({**BASE_ENV.get(case["entry"], {}), **case["env"]}),
        contextlib.redirect_stderr(err),
        contextlib.redirect_stdout(out),
    ):
        try:
            config = (parse or cli.parse_or_exit)(model, case["entry"], "summary", argv, **kwargs)
            dump = flatten(json.loads(config.model_dump_json()))
            base = (defaults or {}).get(case["entry"], {})
            result["set"] = {k: v for k, v in dump.items() if base.get(k, object()) != v}
            result["exit"] = None
        except SystemExit as e:
            result["exit"] = e.code
        except Exception as e:  # noqa: BLE001 - recorded: a user mistake must never escape as another exception
            result["exit"] = f"raised {type(e).__name__}"
            err.write(f"{type(e).__name__}: {e}\n")
    result["stderr"] = [line.replace(str(work), "<TMP>") for line in err.getvalue().splitlines()]
    if out.getvalue():
        result["stdout"] = out.getvalue().replace(str(work), "<TMP>")
    return result


def run_all(parse=None, defaults: dict | None = None) -> dict[str, dict]:
    """Every case; `parse` replaces `cli.parse_or_exit` (to try another parser against the same golden)."""
    with tempfile.TemporaryDirectory() as tmp:
        defaults = defaults or {e: run_case(_case(e, "defaults", []), Path(tmp), parse=parse)["set"] for e in ENTRIES}
        results = {c["id"]: run_case(c, Path(tmp), defaults, parse) for c in all_cases()}
    return {"defaults": defaults, "cases": results}


def lean(result: dict) -> dict:
    """A case's result without its empty parts (no exit code, no stderr, nothing set): what the golden stores."""
    return {k: v for k, v in result.items() if v not in (None, [], {})}


def save_golden(results: dict) -> None:
    """One JSON line for the defaults, then one per case (sorted): small, and a diff names the cases."""
    compact = {"sort_keys": True, "separators": (",", ":"), "ensure_ascii": False}
    lines = [json.dumps({"defaults": results["defaults"]}, **compact)]
    lines += [json.dumps({"id": k, "result": lean(results["cases"][k])}, **compact) for k in sorted(results["cases"])]
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text("\n".join(lines) + "\n", encoding="utf-8")


def load_golden() -> dict:
    first, *rest = (json.loads(line) for line in GOLDEN.read_text(encoding="utf-8").splitlines())
    return {"defaults": first["defaults"], "cases": {r["id"]: r["result"] for r in rest}}


def test_harness_matches_golden():
    golden = load_golden()
    now = run_all()
    again = "if a config field was added or renamed on purpose, record anew (see the module docstring)"
    assert now["defaults"] == golden["defaults"], f"the configs' defaults changed: {again}"
    assert set(now["cases"]) == set(golden["cases"]), f"the cases changed: {again}"
    diff = [k for k in golden["cases"] if lean(now["cases"][k]) != golden["cases"][k]]
    assert not diff, f"{len(diff)} cases differ, e.g. {diff[0]}: {golden['cases'][diff[0]]} -> {now['cases'][diff[0]]}"
    assert len(now["cases"]) >= 800


if __name__ == "__main__":
    results = run_all()
    if "--record" in sys.argv:
        save_golden(results)
    exits: dict = {}
    for r in results["cases"].values():
        exits[str(r["exit"])] = exits.get(str(r["exit"]), 0) + 1
    print(f"{len(results['cases'])} cases; exits: {exits}")


def test_run_guarded_tells_the_caller_how_it_ended(capsys):
    """`run_guarded` reports each ending to the `finish` its caller passes (the entrypoints: the run record)."""
    import pytest

    from asyncrl.core.errors import UserError

    def ends(fn) -> tuple[list, object]:
        seen: list = []
        with pytest.raises(SystemExit) if fn is not None else contextlib.nullcontext() as stop:
            cli.run_guarded(fn or (lambda: None), finish=lambda code, error: seen.append((code, error)))
        return seen, getattr(stop, "value", None) and stop.value.code

    def bad():
        raise UserError("bad flag")

    def interrupted():
        raise KeyboardInterrupt

    assert ends(None) == ([(0, None)], None)
    assert ends(bad) == ([(2, "bad flag")], 2)
    assert ends(interrupted) == ([(130, "interrupted")], 130)
    assert "error: bad flag" in capsys.readouterr().err
