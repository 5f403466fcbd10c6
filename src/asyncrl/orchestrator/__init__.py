"""The orchestrator: verifiers rollouts against the inference server -> advantages -> packed batches."""

from asyncrl.orchestrator.process import run_orchestrator

__all__ = ["run_orchestrator"]
