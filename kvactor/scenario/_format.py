"""The scenario format: TOML parsed into checked msgspec Structs (see ``kvactor.scenario``)."""

from __future__ import annotations

import functools
import re
import string
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

import msgspec

from ..actors.engine import Attention, ModelSpec
from ..actors.errors import InvalidAgentId
from ..actors.hot import POLICIES
from ..actors.ids import check_agent_id
from ..actors.models import make_tiny_model
from ..actors.warm import default_cache_dir
from ._models import models_problem

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = (
    "NO_OUTPUTS",
    "PLACEHOLDERS",
    "POLICIES",
    "CONTEXT_AGENT",
    "AgentSpec",
    "ContextSpec",
    "PhaseSpec",
    "SamplingSpec",
    "Scenario",
    "ScenarioError",
    "load_scenario",
    "parse_scenario",
    "render",
    "resolve_model",
    "scenario_cache_dir",
    "shared_text",
    "turn_prompt",
)

PLACEHOLDERS: Mapping[str, str] = {
    "task": "the scenario's task",
    "agent": "the name of the agent taking the turn",
    "phase": "the name of the phase",
    "outputs": "the other agents' latest outputs as of the start of the phase",
    "own": "this agent's own latest output",
}
NO_OUTPUTS = "(nothing yet)"
CONTEXT_AGENT = "shared"  # the shared context's name in the session (and its warm cache)


class ScenarioError(ValueError):
    """A scenario file that cannot be read, parsed or run; the message names the field."""


# ----------------------------------------------------------------------------- format
Positive = Annotated[int, msgspec.Meta(ge=1)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]


class SamplingSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Sampling defaults for every turn (``temperature = 0`` is greedy)."""

    max_tokens: Positive = 64
    temperature: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    seed: int | None = 0
    stop: list[str] = []


class AgentSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One agent: a name (letters, digits, ``.``, ``_``, ``-``) and its system prompt.

    With a ``shared_context``, every agent's system prompt is the shared text, and
    ``system`` (its role) opens the prompt of its first turn instead. ``fork``: the agent
    starts as a fork of that agent (its conversation and cache) at the start of the first
    phase it speaks in; the source must have spoken in an earlier phase. A fork has no
    ``system`` of its own. ``model``: which of the scenario's ``models`` it runs (default:
    the first; a fork: its source's)."""

    name: str
    system: str | None = None
    fork: str | None = None
    model: str | None = None


class ContextSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A text all agents read first: ``text`` inline, or ``file`` (UTF-8; a relative path
    is relative to the scenario file). Give one of them."""

    text: str | None = None
    file: str | None = None


class PhaseSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One phase: every agent in ``agents`` (default: all) takes one turn on ``prompt``."""

    name: str
    prompt: str
    agents: list[str] | None = None
    max_tokens: Positive | None = None


class Scenario(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A multi-agent workflow.

    - ``model``: "default" (SmolLM2-135M-Instruct), "tiny" (a random 2-layer test model)
      or the path of a ``.gguf`` file or model directory.
    - ``cache_dir``: "auto" (``<default cache dir>/scenarios/<name>/<model>``), "none" (no
      warm tier: demoted caches are lost) or a folder (relative to the working directory).
    - ``resume``: agents resume the warm caches of an earlier run (false: forget them
      first); ``resume_max_tokens``: forget them instead when any holds more tokens.
    - ``budget_mb`` (10^6 bytes) bounds the hot tier; ``hot_agents`` instead sizes it for
      the running turns plus that many idle agents' caches, estimated from the model and
      the prompts. Neither: unbounded.
    - ``policy``: whom to demote ("workflow", fed the plan's order as hints; or "lru");
      ``max_batch`` / ``prefill_chunk`` / ``attention``
      ("auto", "quantized" or "dequantized": see ``kvactor.open``): the engine's;
      ``concurrency``: turns in flight at once within a phase; ``prefetch``: hint the next
      agent's warm cache into memory while the current turn decodes.
    - ``cold_reference``: at the end, prefill the longest turn's prompt again from
      scratch (in a session of its own, so that it shares nothing) to measure what a cold
      turn would have cost; without cold turns in the run, the shortest turn's prompt too.
    - ``shared_context``: a text (a document, shared instructions) that is every agent's
      system prompt. It is prefilled once before the first phase (``Session.context``,
      named ``shared``); each agent's first turn shares its cache instead of prefilling
      it, and its first warm write links the context's files. ``share_prefixes = false``
      turns the sharing off (every first turn prefills the whole prompt: a baseline).
    - ``deterministic``: greedy answers that do not depend on which agents run together
      (batch-invariant decode, ``kvactor.open(deterministic=True)``; ~10% slower here).
    - ``models``: several models in one session, by name (``{ router = "tiny", coder =
      "tiny:1" }``: "tiny:SEED" is a tiny model of other weights); each agent's ``model``
      picks one. ``memory_limit_mb`` (10^6 bytes): the session's limit over weights and
      caches (``kvactor.open(memory_limit=...)``; default: 3/4 of RAM).
    - ``disk_limit_mb`` (10^6 bytes): the warm tier's limit on disk; past it agents go
      cold (their conversation kept) by the policy (``kvactor.open(disk_limit=...)``;
      default: the smaller of 30 GiB and a quarter of the free disk).
    - ``write_budget_mb_per_day`` (10^6 bytes): an SSD write budget, and write-back: caches
      are written as they leave memory, while the budget has room
      (``kvactor.open(write_budget=...)``; default: every turn written through).
    """

    name: str
    task: str = ""
    model: str = "default"
    cache_dir: str = "auto"
    resume: bool = True
    resume_max_tokens: Positive | None = None
    budget_mb: PositiveFloat | None = None
    hot_agents: Annotated[float, msgspec.Meta(ge=0)] | None = None
    policy: str = "workflow"
    max_batch: Positive = 8
    prefill_chunk: Positive = 256
    attention: Attention = "auto"
    concurrency: Positive = 1
    prefetch: bool = False
    cold_reference: bool = True
    share_prefixes: bool = True
    deterministic: bool = False
    shared_context: ContextSpec | None = None
    models: dict[str, str] = {}
    memory_limit_mb: PositiveFloat | None = None
    disk_limit_mb: PositiveFloat | None = None
    write_budget_mb_per_day: PositiveFloat | None = None
    sampling: SamplingSpec = SamplingSpec()
    agents: list[AgentSpec]
    phases: list[PhaseSpec]


def load_scenario(path: str | Path) -> Scenario:
    """Read and check a scenario file (a relative ``shared_context.file`` is relative to
    it). Raises ScenarioError naming the file and field."""
    path = Path(path)
    try:
        data = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ScenarioError(f"{path}: cannot read: {_reason(exc)}") from None
    return parse_scenario(data, source=str(path), base_dir=path.parent)


def _reason(exc: OSError | UnicodeDecodeError) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)


def parse_scenario(
    text: str, *, source: str = "scenario", base_dir: str | Path | None = None
) -> Scenario:
    """Parse TOML text into a checked Scenario. A relative ``shared_context.file`` is
    relative to ``base_dir`` (default: the working directory); the Scenario holds its
    absolute path.

    Raises ScenarioError: invalid TOML (with line and column), a field of the wrong type
    or out of range, an unknown field (``- at `$.phases[1].max_tokens```), or a scenario
    that does not make sense (unknown agent in a phase, duplicate agent, bad placeholder,
    unknown fork source, a fork cycle, a shared context file that cannot be read).
    """
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{source}: invalid TOML: {exc}") from None
    try:
        scenario = msgspec.convert(raw, Scenario)
    except msgspec.ValidationError as exc:
        raise ScenarioError(f"{source}: {exc}") from None
    problem = _problem(scenario)
    if problem is not None:
        message, where = problem
        raise ScenarioError(f"{source}: {message} - at `$.{where}`")
    context = scenario.shared_context
    if context is not None and context.file is not None:
        path = Path(context.file).expanduser()
        path = (Path(base_dir or ".") / path).resolve()  # an absolute path stays as it is
        context = msgspec.structs.replace(context, file=str(path))
        scenario = msgspec.structs.replace(scenario, shared_context=context)
        try:
            shared_text(scenario)
        except ScenarioError as exc:
            raise ScenarioError(f"{source}: {exc}") from None
    return scenario


def shared_text(s: Scenario) -> str | None:
    """The scenario's shared context (read from its file), or None without one. Raises
    ScenarioError when the file cannot be read or holds no text."""
    context = s.shared_context
    if context is None:
        return None
    if context.file is None:
        assert context.text is not None  # checked by parse_scenario
        return context.text
    try:
        text = Path(context.file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = f"cannot read {context.file}: {_reason(exc)}"
        raise ScenarioError(f"{reason} - at `$.shared_context.file`") from None
    if not text.strip():
        raise ScenarioError(f"{context.file} is empty - at `$.shared_context.file`")
    return text


def _problem(s: Scenario) -> tuple[str, str] | None:
    """The first semantic problem, as (message, field path), or None."""
    try:
        check_agent_id(s.name)
    except InvalidAgentId as exc:
        return f"bad scenario name (it names a cache folder): {exc}", "name"
    if s.budget_mb is not None and s.hot_agents is not None:
        return "set budget_mb or hot_agents, not both", "hot_agents"
    if s.policy not in POLICIES:
        return f"unknown policy {s.policy!r}; known: {', '.join(POLICIES)}", "policy"
    if not s.model.strip():
        return "model must be 'default', 'tiny' or a path", "model"
    if not s.cache_dir.strip():
        return "cache_dir must be 'auto', 'none' or a folder", "cache_dir"
    if any(not stop for stop in s.sampling.stop):
        return "stop strings must not be empty", "sampling.stop"
    context = s.shared_context
    if context is not None:
        if (context.text is None) == (context.file is None):
            return "give text or file, not both or neither", "shared_context"
        if context.text is not None and not context.text.strip():
            return "the shared context is empty", "shared_context.text"
        if context.file is not None and not context.file.strip():
            return "file must name a file", "shared_context.file"
    if not s.agents:
        return "a scenario needs at least one agent", "agents"
    names: set[str] = set()
    for i, agent in enumerate(s.agents):
        try:
            check_agent_id(agent.name)
        except InvalidAgentId as exc:
            return str(exc), f"agents[{i}].name"
        if agent.name in names:
            return f"duplicate agent name {agent.name!r}", f"agents[{i}].name"
        if context is not None and agent.name == CONTEXT_AGENT:
            return (
                f"{CONTEXT_AGENT!r} names the shared context; rename the agent",
                f"agents[{i}].name",
            )
        names.add(agent.name)
    if not s.phases:
        return "a scenario needs at least one phase", "phases"
    for i, phase in enumerate(s.phases):
        if not phase.name.strip():
            return "a phase needs a name", f"phases[{i}].name"
        if phase.agents is not None:
            if not phase.agents:
                return "empty agent list (omit it for every agent)", f"phases[{i}].agents"
            seen: set[str] = set()
            for j, name in enumerate(phase.agents):
                if name not in names:
                    known = ", ".join(a.name for a in s.agents)
                    return f"unknown agent {name!r}; agents: {known}", f"phases[{i}].agents[{j}]"
                if name in seen:
                    return f"agent {name!r} listed twice", f"phases[{i}].agents[{j}]"
                seen.add(name)
        problem = _template_problem(phase.prompt)
        if problem is not None:
            return problem, f"phases[{i}].prompt"
    for i, agent in enumerate(s.agents):
        problem = _fork_problem(s, agent)
        if problem is not None:
            return problem, f"agents[{i}].fork"
    return models_problem(s)


def _fork_problem(s: Scenario, agent: AgentSpec) -> str | None:
    if agent.fork is None:
        return None
    if agent.system is not None:
        return "a fork starts from its source's conversation: give fork or system, not both"
    forks = {a.name: a.fork for a in s.agents}
    if agent.fork not in forks:
        return f"unknown fork source {agent.fork!r}; agents: {', '.join(forks)}"
    chain = [agent.name]
    step: str | None = agent.fork
    while step is not None and step not in chain:
        chain.append(step)
        step = forks.get(step)
    if step == agent.name:
        return "fork cycle: " + " -> ".join([*chain, step])
    first = first_phases(s)
    if agent.name not in first:
        return f"agent {agent.name!r} forks {agent.fork!r} but speaks in no phase"
    if first.get(agent.fork, len(s.phases)) >= first[agent.name]:
        phase = s.phases[first[agent.name]].name
        return (
            f"fork source {agent.fork!r} must speak in a phase before {phase!r}, where "
            f"{agent.name!r} first speaks (the fork starts where its source is then)"
        )
    return None


def _template_problem(template: str) -> str | None:
    if not template.strip():
        return "the prompt is empty"
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        return f"{exc} (write {{{{ and }}}} for literal braces)"
    for _, field, spec, conversion in parsed:
        if field is None:
            continue
        if field not in PLACEHOLDERS:
            known = ", ".join("{" + name + "}" for name in PLACEHOLDERS)
            return f"unknown placeholder {{{field}}}; known: {known}"
        if spec or conversion:
            return f"placeholder {{{field}}} takes no format spec or conversion"
    return None


def render(template: str, **values: str) -> str:
    """Fill a checked template's placeholders."""
    return template.format_map(values)


def turn_prompt(
    s: Scenario, phase: PhaseSpec, agent: str, said: Mapping[str, str], *, first: bool = False
) -> str:
    """The prompt of ``agent``'s turn in ``phase``, given each agent's latest output.
    ``first``: the first turn of its conversation, which a shared context's agent's role
    (its ``system``) opens."""
    others = [f"{n}: {said[n]}" for n in (a.name for a in s.agents) if n != agent and n in said]
    text = render(
        phase.prompt,
        task=s.task,
        agent=agent,
        phase=phase.name,
        outputs="\n\n".join(others) or NO_OUTPUTS,
        own=said.get(agent, NO_OUTPUTS),
    )
    if first and s.shared_context is not None:
        role = next((a.system for a in s.agents if a.name == agent), None)
        if role:
            text = f"{role}\n\n{text}"
    return text


def turn_plan(s: Scenario) -> list[tuple[int, PhaseSpec, list[str]]]:
    """(index, phase, the names of its agents in turn order) for every phase."""
    every = [a.name for a in s.agents]
    return [(i, p, list(p.agents) if p.agents else every) for i, p in enumerate(s.phases)]


def first_phases(s: Scenario) -> dict[str, int]:
    """The index of the first phase each agent speaks in (agents that never speak: absent)."""
    first: dict[str, int] = {}
    for i, _, names in turn_plan(s):
        for name in names:
            first.setdefault(name, i)
    return first


# ------------------------------------------------------------------------------ setup
def resolve_model(spec: str) -> ModelSpec:
    """The model to open for a scenario's ``model`` field. Raises ScenarioError for a
    path that does not exist."""
    if spec == "default":
        return None
    seed = spec.removeprefix("tiny:")
    if spec == "tiny" or (seed != spec and seed.isdigit()):
        # Room for the shipped shared document, ~6,100 bytes: the tokenizer is bytewise.
        return functools.partial(
            make_tiny_model,
            int(seed) if seed != spec else 0,
            head_dim=64,
            max_position_embeddings=16384,
        )
    path = Path(spec).expanduser()
    if not path.exists():
        raise ScenarioError(f"model: no such file or directory: {path} - at `$.model`")
    return path


def scenario_cache_dir(scenario: Scenario) -> Path | None:
    """Where the scenario's warm tier lives (None: no warm tier). "auto" keeps one folder
    per scenario and model, so runs on another model do not meet each other's caches."""
    if scenario.cache_dir == "none":
        return None
    if scenario.cache_dir != "auto":
        return Path(scenario.cache_dir).expanduser()
    model = scenario.model
    if scenario.models:  # a session of several models: a folder per model inside
        model = "models-" + "-".join(scenario.models)
    elif model not in ("default", "tiny"):
        model = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(model).name).strip("._") or "model"
    return default_cache_dir() / "scenarios" / scenario.name / model
