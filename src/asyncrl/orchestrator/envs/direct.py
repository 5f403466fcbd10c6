"""Direct v1 episodes: verifiers' episode, agents and traces, without the per-episode transport machinery.

A v1 episode through verifiers' own path costs a framework's worth of work per rollout: a runtime, an
interception server registration, the chat loop posting every model call over HTTP to that server, the
training client posting it again to the engine through the OpenAI SDK from a worker thread, one request per
rollout of a group. Where none of that machinery can change what is recorded, an episode runs direct:

- the environment's own `Env.run_episode` runs (its `setup`, `run` and `finalize` hooks, several agents
  included), with agents that are verifiers' episode agents (`_EpisodeAgent`: standing, gate, retries) except
  for how one agent run is carried out: `DirectRollout` instead of verifiers' `Rollout`;
- `DirectRollout` keeps the rollout's lifecycle (trace minted with the agent's config, the runtime started,
  task setup, limits and `@stop`s checked before every model call by verifiers' own `RolloutSession`, the chat
  loop's turns and tool-call handling, finalize, the task's and harness's scoring, stops and errors recorded
  as verifiers records them) and makes each model call a function call: the turn is prepared and committed
  on verifiers' trace graph, and sampled by `GroupSampler` (one request per group for a shared prompt).

Which agent runs go direct (`agent_reason`, `task_reason`): the agent's harness is asyncrl's chat loop (`asyncrl-chat`),
its runtime the local subprocess one, its task has no tool servers (task- or taskset-scoped), no
`@intercept` hooks, no `@stop` on a Request or Response, no skills, no `agent_user` (the subprocess runtime has
no network policy to give notice of); the client is the training client. Every other run takes verifiers'
own path, unchanged.

Invariants: a direct episode records what verifiers' path records for the same engine answers — the same
trace graph (messages, token ids, sampled masks, logprobs), stop condition, errors, rewards and metrics; the
differential test (tests/unit/orchestrator/test_v1_direct.py) runs every shipped environment both ways.
What it leaves out: the per-call HTTP records of the interception layer (a call's `sampling` is the
episode's, not re-parsed from a request body).

Private parts of verifiers 0.4.0 used (tripwire: test_the_library_internals_direct_episodes_use_are_as_they_were;
remove when verifiers offers an in-process model call for its episodes): `Env._episode_agents` (wrapped per env
instance, its agents' class set to `DirectAgent`), `Agents._agents`, `Agent._run_once`, `Agent._rollout_params`,
`_EpisodeAgent`, `Interaction(run, gate)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from contextlib import asynccontextmanager, nullcontext
from typing import Any

from loguru import logger
from verifiers.v1.agent import Agent, Interaction, _EpisodeAgent
from verifiers.v1.errors import HarnessError, ProviderError, TaskError, boundary
from verifiers.v1.runtimes import SubprocessConfig, make_runtime
from verifiers.v1.session import RolloutSession, hook_boundary
from verifiers.v1.state import state_cls
from verifiers.v1.trace import AgentInfo, ModelCall, TimeSpan, Trace, TraceTask
from verifiers.v1.types import Response, SystemMessage, ToolMessage, UserMessage
from verifiers.v1.utils.decorators import discover_decorated, invoke

from asyncrl.orchestrator.envs.harness import chat_program
from asyncrl.orchestrator.envs.sampler import GroupSampler
from asyncrl.orchestrator.envs.v1 import HARNESS_ID

CHAT_ENDPOINT = "/chat/completions"  # where the chat loop's calls go on verifiers' path (recorded per call)


def agent_reason(agent: Agent) -> str | None:
    """Why an agent's runs need verifiers' own path whatever the task, or None."""
    if agent.harness.config.id != HARNESS_ID:
        return f"harness {agent.harness.config.id!r}"
    if not isinstance(agent.runtime_config, SubprocessConfig):
        return f"runtime {agent.runtime_config.type!r}"
    if agent.harness.config.skills:
        return "skills"
    return None


def task_reason(task: Any, stops: list) -> str | None:
    """Why a task's runs need verifiers' own path, or None."""
    if task.data.skills or task.data.agent_user:
        return "skills or an agent user"
    if task.toolsets(task.config):
        return "per-task tool servers"
    if discover_decorated(task, "intercept"):
        return "@intercept hooks"
    if any(hook_boundary(fn, allow_trace=True) is not Trace for fn in stops):
        return "a @stop on a request or response"
    return None


class TaskFacts:
    """A task's `@stop` hooks and `task_reason`, found once per task object: a group's episodes share their
    task, and finding hooks walks the task's attributes and their annotations."""

    LIMIT = 4096  # tasks remembered (then forgotten all at once)

    def __init__(self) -> None:
        self.known: dict[int, tuple[Any, list, str | None]] = {}

    def of(self, task: Any) -> tuple[list, str | None]:
        hit = self.known.get(id(task))
        if hit is None or hit[0] is not task:
            if len(self.known) >= self.LIMIT:
                self.known.clear()
            stops = task.hooks("stop")
            hit = self.known[id(task)] = (task, stops, task_reason(task, stops))
        return hit[1], hit[2]


class DirectRuns(Agent):
    """The part of an Agent that carries out one run (`_run_once`) and one exchange (`interaction`): direct
    where `agent_reason` and `task_reason` allow, else verifiers' own. Placed under `_EpisodeAgent` in `DirectAgent`."""

    sampler: GroupSampler
    facts: TaskFacts
    toolbox: Toolbox | None = None

    def _direct(self, task: Any, tools: Any, runtime: Any) -> bool:
        """A run goes direct with no tool servers or exactly the environment's shared ones (the toolbox's)."""
        known = self.toolbox is not None and set(tools or {}) == set(self.toolbox.servers)
        return runtime is None and (not tools or known) and not agent_reason(self) and not self.facts.of(task)[1]

    async def _run_once(self, task, runtime, shared_tools, on_trace, collect_artifacts) -> Trace:
        if collect_artifacts or not self._direct(task, shared_tools, runtime):
            return await super()._run_once(task, runtime, shared_tools, on_trace, collect_artifacts)
        run = self._rollout(task, on_trace, has_user=False, tools=shared_tools)
        try:
            if await run.open():
                await run.step()
                if run.ok:
                    run.trace.stop("agent_completed")
            return await run.close()
        except BaseException:
            await asyncio.shield(run.abort())
            raise

    @asynccontextmanager
    async def interaction(self, task, *, runtime=None, tools=None, on_trace=None):
        if not self._direct(task, tools, runtime):
            async with super().interaction(task, runtime=runtime, tools=tools, on_trace=on_trace) as exchange:
                yield exchange
            return
        self._check_resume_support()
        run = self._rollout(task, on_trace, has_user=True, tools=tools)
        exchange = Interaction(run, gate=self._gate)
        async with self._gate or nullcontext():
            if not await run.open() and run.failure is not None:
                await run.close()
                raise run.failure
        try:
            yield exchange
        except Exception as e:
            run.fail(e)
            raise
        except BaseException:
            await exchange._cancel_deliveries()
            await run.abort()
            raise
        finally:
            if not run.closed:
                await exchange.close()

    def _rollout(self, task: Any, on_trace: Any, has_user: bool, tools: Any) -> DirectRollout:
        params = self._rollout_params(task, None, dict(tools or {}))  # verifiers' pairing checks, timeouts, limits
        return DirectRollout(
            task=task,
            agent_config=self.config,
            harness=params["harness"],
            ctx=self.ctx,
            runtime_config=params["runtime_config"],
            timeouts=params["timeouts"],
            limits=params["limits"],
            sampler=self.sampler,
            toolbox=self.toolbox if tools else None,
            stops=self.facts.of(task)[0],
            has_user=has_user,
            on_trace=on_trace,
        )


class DirectAgent(_EpisodeAgent, DirectRuns):
    """verifiers' episode agent whose runs go direct where they can."""


class DirectEpisodes:
    """The slots whose episodes run direct, the sampler their model calls share, and each environment's
    connection to its shared tool servers (`V1Runner.direct`)."""

    def __init__(self, client: Any, timeout: float | None = None, merge: bool = True) -> None:
        self.sampler = GroupSampler(client, timeout, merge)
        self.chosen: dict[int, bool] = {}  # id(env) -> whether its episodes run direct
        self.toolboxes: list[Toolbox] = []

    async def ready(self, slot: Any, serve: Any) -> bool:
        """Whether the slot's episodes run direct, decided at its first group and said once in the log.
        `serve(env)` enters the environment's serving resources (its shared tool servers): an environment
        that has some is served either way, and runs direct only when none carries per-rollout state."""
        env = slot.env
        if id(env) not in self.chosen:
            why = env_direct_reason(env)
            toolbox = None
            if why is None and env.taskset.toolsets(env.taskset.config):
                await serve(env)
                toolbox, why = await Toolbox.connect(env)
            self.chosen[id(env)] = why is None
            if why is None:
                direct_agents(env, self.sampler, toolbox)
                self.toolboxes += [toolbox] if toolbox is not None else []
                logger.info(f"environment '{slot.name}': episodes run direct (one request per group's shared prompt)")
            else:
                logger.info(f"environment '{slot.name}': episodes run through verifiers' machinery ({why})")
        return self.chosen[id(env)]

    async def close(self) -> None:
        for toolbox in self.toolboxes:
            await toolbox.close()
        self.toolboxes.clear()
        await self.sampler.close()


class Toolbox:
    """An environment's shared tool servers as its direct episodes call them: the chat program's own MCP
    client (`connect_mcp`, `call_mcp`, its content conversion), connected once for all episodes, with up to
    `POOL` connections per server (one connection serializes its calls)."""

    POOL = 8

    def __init__(self, shared: dict, timeout: float) -> None:
        self.config = {"mcpServers": {name: {"url": s.url, "timeout": timeout} for name, s in shared.items()}}
        self.servers: dict[str, Any] = dict(shared)
        self.schemas: list[dict] = []
        self.tools: list[Any] | None = None  # typed, as verifiers parses them from a request's `tools`
        self.dispatch: dict[str, tuple[str, str]] = {}
        self.idle: list[tuple[contextlib.AsyncExitStack, dict]] = []
        self.made = 0
        self.free = asyncio.Condition()

    @classmethod
    async def connect(cls, env: Any) -> tuple[Toolbox | None, str | None]:
        """The env's toolbox (its `serving()` entered), or why its tools need verifiers' path."""
        from verifiers.v1.dialects.chat import parse_tools

        shared = env._shared_tools
        if any(server.state_secret for server in shared.values()):
            return None, "a tool server with per-rollout state"
        if any(not server.local and not server.external for server in shared.values()):
            return None, "a tool server in a remote runtime"
        harness = next(iter(env._harnesses.values()))
        toolbox = cls(shared, harness.config.tool_timeout)
        toolbox.idle.append(await toolbox.open())
        toolbox.made = 1
        toolbox.tools = parse_tools(toolbox.schemas or None)
        return toolbox, None

    async def open(self) -> tuple[contextlib.AsyncExitStack, dict]:
        stack = contextlib.AsyncExitStack()
        schemas, dispatch, connections = await chat_program()["connect_mcp"](self.config, stack, set())
        self.schemas, self.dispatch = schemas, dispatch
        return stack, connections

    async def opened(self) -> tuple[contextlib.AsyncExitStack, dict]:
        """A new connection in the place `call` took for it; the place is given back if it fails to open."""
        try:
            return await self.open()
        except BaseException:
            async with self.free:
                self.made -= 1
                self.free.notify()
            raise

    async def call(self, name: str, arguments: dict) -> Any:
        """The tool's result as the chat loop puts it into a tool message."""
        async with self.free:
            while not self.idle and self.made >= self.POOL:
                await self.free.wait()
            taken = self.idle.pop() if self.idle else None
            self.made += taken is None  # the new connection's place, taken before it is opened
        if taken is None:
            taken = await self.opened()
        try:
            return await chat_program()["call_mcp"](taken[1], self.dispatch, name, arguments)
        finally:
            async with self.free:
                self.idle.append(taken)
                self.free.notify()

    async def close(self) -> None:
        for stack, _ in self.idle:
            with contextlib.suppress(Exception):
                await stack.aclose()
        self.idle.clear()


def env_direct_reason(env: Any) -> str | None:
    """Why `env`'s episodes need verifiers' own path, or None when its agents can run direct: no per-task tool
    servers, every seat on asyncrl's chat loop in the local subprocess runtime (shared tool servers are
    checked once running: `Toolbox.connect`; a task can still send one run back: `task_reason`)."""
    if env._task_cls.toolsets(env.taskset.config.task):
        return "per-task tool servers"
    for name, spec in env._agent_specs.items():
        harness = env._harnesses[name].config.id
        if harness != HARNESS_ID:
            return f"agent {name!r} runs harness {harness!r}"
        if not isinstance(spec.runtime, SubprocessConfig):
            return f"agent {name!r} runs in runtime {spec.runtime.type!r}"
    return None


def direct_agents(env: Any, sampler: GroupSampler, toolbox: Toolbox | None = None) -> None:
    """Make `env`'s episodes build `DirectAgent`s: `Env._episode_agents` builds `_EpisodeAgent`s through one
    `make(name, spec)`; this wraps it to build the same agent as a DirectAgent (same instance state)."""
    build, facts = type(env)._episode_agents, TaskFacts()

    def episode_agents(ctx, completed, on_trace, on_discard):
        agents = build(env, ctx, completed, on_trace, on_discard)
        for agent in agents._agents.values():
            agent.__class__ = DirectAgent
            agent.sampler, agent.toolbox, agent.facts = sampler, toolbox, facts
        return agents

    env._episode_agents = episode_agents


class DirectRollout:
    """One agent run of a direct episode: verifiers' `Rollout` lifecycle (open, step, close, abort, fail,
    timeout; `ok`, `closed`, `failure`, `trace`) with each model call made in this process."""

    def __init__(
        self,
        *,
        task,
        agent_config,
        harness,
        ctx,
        runtime_config,
        timeouts,
        limits,
        sampler,
        toolbox,
        stops,
        has_user,
        on_trace,
    ):
        self.task, self.harness, self.ctx, self.sampler, self.toolbox = task, harness, ctx, sampler, toolbox
        self.runtime_config, self.timeouts, self.has_user = runtime_config, timeouts, has_user
        self.trace = Trace(
            task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            state=state_cls(type(task))(),
            agent=AgentInfo(config=agent_config),
        )
        if on_trace is not None:
            on_trace(self.trace)
        self.session = RolloutSession(ctx=ctx, trace=self.trace, trace_stops=stops, limits=limits)
        self.runtime: Any = None
        self._failed, self._failure, self._opened, self._closed = False, None, False, False
        self._agent_left = timeouts.agent
        self.deadline_at: float | None = None

    @property
    def ok(self) -> bool:
        return not self._failed and self.trace.stop_condition is None

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def failure(self) -> Exception | None:
        return self._failure

    def fail(self, error: Exception) -> None:
        self._failed, self._failure = True, error
        self.trace.record_error(error)

    def timeout(self, stage: str) -> None:
        self.trace.record_timeout(stage)

    async def steer(self, message: str, *, message_id: str | None = None) -> dict:
        return {"outcome": "promptRequired", "reason": "noRunningTurn"}

    async def open(self) -> bool:
        """Start the runtime and run task and harness setup; whether the exchange can go on."""
        self._opened = True
        trace = self.trace
        trace.timing.boot.start = time.time()
        self.runtime = runtime = make_runtime(self.runtime_config, name=trace.id)
        trace.agent.runtime = runtime.info
        try:
            runtime.env = dict(self.task.runtime_env())
            if self.task.data.prompt is None and not self.has_user:
                raise TaskError("task has no prompt and no user to open the conversation; set task.prompt")
            await runtime.start()
            await runtime.prepare_setup()
            trace.timing.boot.end = trace.timing.setup.start = time.time()
            await self._setup(runtime)
        except TimeoutError:
            self.timeout("setup")
            return False
        except Exception as e:  # the setup boundary: recorded on the trace
            self.fail(e)
            return False
        except BaseException:
            await self.abort()
            raise
        trace.timing.setup.end = trace.timing.agent.start = time.time()
        return not self.session.stopped

    async def _setup(self, runtime: Any) -> None:
        async with asyncio.timeout(self.timeouts.setup):
            async with boundary(TaskError, "task setup"):
                await invoke(self.task.setup, {"trace": self.trace, "runtime": runtime})
            async with boundary(HarnessError, "harness setup"):
                await self.harness.setup(runtime)

    async def step(self, messages=None, *, on_input=None) -> bool:
        """One segment: the chat loop on the task's prompt (`messages` None) or on the conversation plus
        `messages` (a resumed exchange), to a reply without tool calls. Whether the exchange can go on."""
        if not self._opened or self._closed or not self.ok:
            return False
        trace = self.trace
        turns_before, root_before = trace.num_turns, trace.root_reply
        trace.root_reply = None
        loop = asyncio.get_running_loop()
        started = loop.time()
        self.deadline_at = None if self._agent_left is None else started + max(0.0, self._agent_left)
        try:
            async with asyncio.timeout_at(self.deadline_at):
                await self._segment(messages, on_input)
        except TimeoutError as e:
            expired = self.deadline_at is not None and loop.time() >= self.deadline_at
            self.timeout("agent") if expired else self.fail(e)
            return False
        except Exception as e:  # the harness boundary: recorded on the trace
            if not self.session.stopped:
                self.fail(e)
            return False
        finally:
            if trace.num_turns == turns_before:
                trace.root_reply = root_before
            if self._agent_left is not None:
                self._agent_left = max(0.0, self._agent_left - (loop.time() - started))
            self.deadline_at = None
        return self.ok and trace.num_turns > turns_before

    async def _segment(self, messages, on_input) -> None:
        """The chat loop (verifiers' chat program's) with its model calls made here."""
        conversation = self._conversation(messages)
        while True:
            if await self.session.refused() is not None:
                return  # a limit or @stop ended the exchange: a clean exit, as on verifiers' path
            reply = await self._call(conversation, on_input)
            on_input = None
            if reply is None:
                return  # the context is full: the loop ends with the transcript so far
            conversation = [*conversation, reply]
            if not reply.tool_calls:
                return
            conversation += [await self._tool_result(call) for call in reply.tool_calls]

    async def _tool_result(self, call: Any) -> ToolMessage:
        """The chat loop's tool message for a call: the tool's result (through the toolbox), or its error
        text for bad arguments or an unknown tool, bounded as the loop bounds every result."""
        from verifiers.v1.harnesses.utils.compaction import bound_tool_message

        try:
            args = json.loads(call.arguments or "{}")
        except json.JSONDecodeError as e:
            content = f"error: invalid JSON in tool arguments ({e}); resend the call with valid JSON"
        else:
            if not isinstance(args, dict):
                content = f"error: tool arguments must be a JSON object, got {type(args).__name__}; resend as an object"
            elif self.toolbox is not None and call.name in self.toolbox.dispatch:
                content = await self.toolbox.call(call.name, args)
            else:
                content = f"error: unknown tool {call.name!r}"
        message = {"role": "tool", "tool_call_id": call.id, "content": content, "name": call.name}
        return ToolMessage.model_validate(bound_tool_message(message))

    def _conversation(self, messages) -> list:
        """The messages the chat loop sends first: the task's prompt, or the branch plus the user's turn."""
        data = self.trace.task.data
        if messages is not None:
            branch = self.trace.branches[-1].messages if self.trace.branches else []
            kept = [m for m in branch if m.role != "system" or data.system_prompt is None]
            data = data.model_copy(update={"prompt": [*kept, *messages]})
        system, prompt = self.harness.resolve_prompt(data)
        head = [SystemMessage(content=system)] if system else []
        return [*head, *([UserMessage(content=prompt)] if isinstance(prompt, str) else list(prompt or []))]

    async def _call(self, conversation: list, on_input) -> Any:
        """One model call on the trace graph; the committed assistant message, or None on a full context."""
        from verifiers.v1 import graph

        tools = self.toolbox.tools if self.toolbox is not None else None
        turn = graph.prepare_turn(self.trace, conversation, tools)
        self.trace.preview(turn, turn.tail)
        if on_input is not None:
            on_input()
        started = time.time()
        try:
            response = await self.sampler.sample(turn, self.ctx)
        except ProviderError as e:
            turn.abandon()
            self._record(None, None, started, e)
            if overflowed(e):
                return None
            raise
        except BaseException as e:
            turn.abandon()
            self._record(None, None, started, e)
            raise
        node = turn.commit(response)
        self._record(node, response, started, None)
        return self.trace.nodes[node].message

    def _record(self, node: int | None, response: Response | None, started: float, error: BaseException | None):
        """The call's record on the trace (`Trace.calls`), as the interception layer keeps one."""
        from verifiers.v1.trace import Error

        failure = None
        if error is not None:
            failure = Error(
                type=type(error).__name__, message=str(error), status_code=getattr(error, "status_code", None)
            )
        self.trace.calls.append(
            ModelCall(
                node=node,
                model=self.ctx.model,
                sampling=self.ctx.sampling,
                endpoint=CHAT_ENDPOINT,
                finish_reason=response.finish_reason if response is not None else None,
                usage=response.usage if response is not None else None,
                time=TimeSpan(start=started, end=time.time()),
                error=failure,
            )
        )

    async def close(self) -> Trace:
        """Finalize and score (not after a failure), then tear the runtime down. Idempotent."""
        if self._closed:
            return self.trace
        self._closed = True
        trace, runtime = self.trace, self.runtime
        try:
            if trace.timing.agent.start and not trace.timing.agent.end:
                trace.timing.agent.end = time.time()
            if not self._failed and self._opened:
                await self._finalize_and_score(runtime)
        except Exception as e:  # the finalize boundary: recorded on the trace
            self.fail(e)
        finally:
            self._conclude()
            await self._teardown()
        return trace

    async def _finalize_and_score(self, runtime: Any) -> None:
        timing = self.trace.timing
        timing.finalize.start = time.time()
        try:
            async with asyncio.timeout(self.timeouts.finalize), boundary(TaskError, "task finalize"):
                await invoke(self.task.finalize, {"trace": self.trace, "runtime": runtime})
        except TimeoutError:
            self.timeout("finalize")
        timing.finalize.end = timing.scoring.start = time.time()
        try:
            async with asyncio.timeout(self.timeouts.scoring), boundary(TaskError, "scoring"):
                await asyncio.gather(self.task.score(self.trace, runtime), self.harness.score(self.trace, runtime))
        except TimeoutError:
            self.timeout("scoring")
        timing.scoring.end = time.time()

    def _conclude(self) -> None:
        trace = self.trace
        trace.is_completed, trace.ok = True, not self._failed
        now = time.time()
        t = trace.timing
        for span in (t.boot, t.setup, t.agent, t.finalize, t.scoring):
            if span.start and not span.end:
                span.end = now
        trace.split_agent_time()
        if trace.agent.runtime is not None:
            trace.agent.runtime.borrowed = False

    async def _teardown(self) -> None:
        if self.runtime is None:
            return
        with contextlib.suppress(Exception):
            await self.harness.cleanup(self.trace, self.runtime)
        with contextlib.suppress(Exception):
            await self.runtime.stop()

    async def abort(self) -> None:
        """Free the runtime without finalizing or scoring (a cancellation)."""
        self._closed = True
        await self._teardown()


def overflowed(error: ProviderError) -> bool:
    """Whether a failed call is the context running out (the chat loop then ends cleanly), by the chat
    program's own markers."""
    details = str(error).casefold()
    markers = chat_program()["CONTEXT_OVERFLOW_MARKERS"]
    return getattr(error, "status_code", None) in (400, 413) and any(m in details for m in markers)
