"""The verifiers v1 harness plugin `asyncrl-chat`: verifiers' chat loop run inside the orchestrator.

verifiers finds a harness by id as an installed top-level module exporting a Harness subclass; this is that
module for asyncrl's in-process harness (the code is `asyncrl.orchestrator.envs.harness`).
"""

from asyncrl.orchestrator.envs.harness import InProcessHarness

__all__ = ["InProcessHarness"]
