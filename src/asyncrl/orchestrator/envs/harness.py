"""The in-process chat harness for verifiers v1 agents (harness id `asyncrl-chat`, module `asyncrl_chat`).

verifiers' `null` harness runs its chat program (the model-call / tool-call loop) as a separate Python
process per episode: on a small machine that start-up (~1 s of CPU) costs more than the episode. This
harness loads that same program once into this process (`chat_program`) and runs its loop, MCP tool
wiring included, as a coroutine in the orchestrator. verifiers allows this: the contract is that every model call goes
through the episode's interception endpoint, which this loop does, so stops, turns, tools and token
capture behave as with `null`.

Invariant: a failure inside the loop comes back as a non-zero ProgramResult with the error's last line,
the way a failed program would, so verifiers records it on the trace and the rollout counts as failed.
"""

from __future__ import annotations

import argparse
import functools
from contextlib import AsyncExitStack

from verifiers.v1.configs.harness import HarnessConfig
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harness import Harness
from verifiers.v1.runtimes import ProgramResult

from asyncrl.orchestrator.envs.http import shared_http
from asyncrl.orchestrator.envs.v1 import HARNESS_ID


class InProcessHarnessConfig(HarnessConfig):
    id: str = HARNESS_ID


class InProcessHarness(Harness[InProcessHarnessConfig]):
    """verifiers' chat loop (text replies, MCP tools), run in this process."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True
    SUPPORTS_TOOL_INTERCEPTION = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def setup(self, runtime) -> None:
        """Nothing to install: the loop is this process's code."""

    async def launch(
        self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None
    ) -> ProgramResult:
        system_prompt, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages.extend(message_to_wire(m) for m in prompt)
        servers = {name: {"url": url, "timeout": self.config.tool_timeout} for name, url in mcp_urls.items()}
        try:
            await chat(endpoint, secret, ctx.model, messages, servers, tool_interception_url)
        except Exception as e:  # the program's exit: verifiers turns it into the trace's error
            return ProgramResult(exit_code=1, stdout="", stderr=f"{type(e).__name__}: {e}")
        return ProgramResult(exit_code=0, stdout="", stderr="")


@functools.cache
def chat_program() -> dict:
    """verifiers' chat program (the null harness's: its utils modules bundled into one script), loaded once
    into a namespace of its own: its modules call each other as the one script's globals."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE

    namespace = {"__name__": "asyncrl_chat_program"}  # not __main__: the script's entry point stays inert
    exec(compile(CHAT_PROGRAM_SOURCE, "<verifiers chat program>", "exec"), namespace)
    return namespace


async def chat(
    endpoint: str, secret: str, model: str, messages: list[dict], servers: dict, tool_interception_url: str | None
) -> None:
    """The chat program's main, minus argv and files: connect the tools, then run the loop."""
    from openai import AsyncOpenAI

    program = chat_program()
    args = argparse.Namespace(tool_interception_url=tool_interception_url or "", bash=False, edit=False, search=False)
    # one connection pool per event loop: a client of its own per episode would load the CA bundle each time
    client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0, http_client=shared_http())
    async with AsyncExitStack() as stack:
        tools, dispatch, connected = [], {}, {}
        if servers:
            tools, dispatch, connected = await program["connect_mcp"]({"mcpServers": servers}, stack, set())
        compactor = program["Compactor"](client, model, tools, False, None)
        compactor.note_good(messages)
        await program["run_chat_loop"](args, compactor, messages, dispatch, connected, shared_http())


__all__ = ["InProcessHarness"]
