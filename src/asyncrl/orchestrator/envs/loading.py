"""Load a verifiers environment by id: an installed package, a v1 taskset or (verifiers < 0.4) a classic one.

Environments are installed packages. A package exporting a verifiers v1 Taskset loads through `envs.v1`
(verifiers >= 0.4 has only these); a classic one with `verifiers.load_environment(id, **args)` where
verifiers < 0.4 is installed. Invariant: a missing or failing environment is a UserError saying how to install
or fix it; verifiers' classic modules are imported only when a classic environment is loaded.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from asyncrl.config.orchestrator import EnvConfig
from asyncrl.core.errors import UserError
from asyncrl.orchestrator.envs.v1 import is_v1_module, load_v1_env


def env_module(env_id: str) -> str:
    return env_id.replace("-", "_").split("/")[-1]


# PRIME-RL's benchmark and math environments: verifiers environments on Prime Intellect's Environments Hub
# (not on PyPI), by the id the PRIME-RL docs use.
HUB_ENVIRONMENTS = {
    "math500": "primeintellect/math500",
    "aime2024": "primeintellect/aime2024",
    "aime2025": "primeintellect/aime2025",
    "gpqa": "primeintellect/gpqa",
    "hendrycks-math": "primeintellect/hendrycks-math",
    "intellect-math": "primeintellect/intellect-math",
}


def install_hint(env_id: str) -> str:
    network = " (needs network)" if env_id in HUB_ENVIRONMENTS or "/" in env_id else ""
    then = f', then use id = "{env_id.split("/", 1)[1]}"' if "/" in env_id else ""
    return f"install it with {install_commands(env_id)}{network}{then}"


def install_commands(env_id: str) -> str:
    """How to install an environment: from the Environments Hub (owner/name, or one of PRIME-RL's), else locally."""
    hub_id = HUB_ENVIRONMENTS.get(env_id, env_id if "/" in env_id else None)
    if hub_id is not None:
        owner, name = hub_id.split("/", 1)
        return (
            f"`prime env install {hub_id}` or `uv pip install {name} "
            f"--extra-index-url https://hub.primeintellect.ai/{owner}/simple/`"
        )
    return f"`uv pip install -e environments/{env_module(env_id)}` (a local environment) or `pip install {env_id}`"


def check_installed(env_ids: list[str]) -> None:
    """Every missing environment in one error, rather than one per attempt (a single one: `load_env` says it)."""
    missing = [i for i in dict.fromkeys(env_ids) if importlib.util.find_spec(env_module(i)) is None]
    if len(missing) < 2:
        return
    hints = "; ".join(f"{i}: {install_commands(i)}" for i in missing)
    raise UserError(f"environments not installed: {', '.join(missing)}; install them with {hints}")


def installed_module(env_id: str) -> str:
    """The module of environment `env_id`; a UserError with how to install it when it is not installed."""
    module = env_module(env_id)
    if importlib.util.find_spec(module) is None:
        raise UserError(f"environment '{env_id}' is not installed (no module '{module}'); {install_hint(env_id)}")
    return module


def load_env(cfg: EnvConfig, eval_split: bool = False) -> Any:
    """The environment `cfg` names: a verifiers v1 taskset package, else a classic one
    (`verifiers.load_environment(cfg.id, **cfg.args)`, where verifiers < 0.4 provides it); user-facing errors."""
    module = installed_module(cfg.id)
    if is_v1_module(module):
        return load_v1_env(module, cfg.id, cfg.args, eval_split=eval_split)
    import verifiers as vf

    if not hasattr(vf, "load_environment"):
        raise UserError(
            f"environment '{cfg.id}' is not a verifiers v1 environment (its package exports no v1 Taskset), and "
            f"verifiers {vf.__version__} loads only those: port it to verifiers.v1 (docs/rl.md, 'verifiers v1 "
            "environments') or, for a classic environment, install verifiers<0.4"
        )
    try:
        return vf.load_environment(module, **cfg.args)
    except (TypeError, ValueError, RuntimeError) as e:
        cause = e.__cause__ or e
        raise UserError(f"environment '{cfg.id}' failed to load with args {cfg.args}: {cause}") from e
