"""Scenarios: multi-agent, multi-phase workflows described in TOML, run on one session.

A scenario names agents (each with a system prompt) and phases. In every phase each of
its agents takes one chat turn whose prompt is rendered from the phase's template, which
may quote the other agents' outputs of earlier phases (``{outputs}``): the paper's
cross-phase context injection. Each turn is a new user message in the agent's own
conversation, so its cached prompt grows and the next turn EXTENDs it. With a hot budget
smaller than every agent's working set, caches are demoted to the warm tier (files) and
reloaded when their agent speaks again; a second run with the same cache folder resumes
every agent from disk.

``run_scenario`` returns one ``TurnRecord`` per turn, a summary of TTFT by path and the
time saved against re-prefilling every prompt, and the engine's statistics. The format::

    name = "review"                 # names the default cache folder
    task = "a JSON config loader"   # {task} in prompts
    model = "default"               # "default" | "tiny" (random test model) | a path
    cache_dir = "auto"              # "auto" | "none" (no warm tier) | a folder
    hot_agents = 2                  # or budget_mb = 80.0 (omit both: no budget)
    concurrency = 1                 # turns in flight at once within a phase
    [sampling]                      # defaults for every turn
    max_tokens = 48
    [[agents]]
    name = "author"
    system = "You write Python."
    [[phases]]
    name = "draft"
    prompt = "Write {task}. Earlier: {outputs}"
    agents = ["author"]             # default: every agent, in [[agents]] order

A ``[shared_context]`` (``text = "..."`` or ``file = "doc.md"``, relative to the scenario
file) is a text every agent reads first: it is prefilled once, as the system prompt of a
shared context, and every agent's first turn shares that cache instead of prefilling it
(an agent's own ``system`` then opens its first prompt). An agent with ``fork =
"author"`` starts as a fork of that agent (its conversation and cache, not copied) at the
start of the first phase it speaks in; the source must have spoken before. Results count
per turn the tokens shared (``TurnRecord.shared_tokens``) and in total what sharing
saved (``Summary.sharing``, ``Results.footprint``).

See ``Scenario`` for every field and ``PLACEHOLDERS`` for the template names.
"""

from __future__ import annotations

from ._estimate import estimate_budget as estimate_budget
from ._estimate import estimate_context as estimate_context
from ._format import CONTEXT_AGENT as CONTEXT_AGENT
from ._format import NO_OUTPUTS as NO_OUTPUTS
from ._format import PLACEHOLDERS as PLACEHOLDERS
from ._format import POLICIES as POLICIES
from ._format import AgentSpec as AgentSpec
from ._format import ContextSpec as ContextSpec
from ._format import PhaseSpec as PhaseSpec
from ._format import SamplingSpec as SamplingSpec
from ._format import Scenario as Scenario
from ._format import ScenarioError as ScenarioError
from ._format import load_scenario as load_scenario
from ._format import parse_scenario as parse_scenario
from ._format import render as render
from ._format import resolve_model as resolve_model
from ._format import scenario_cache_dir as scenario_cache_dir
from ._format import shared_text as shared_text
from ._format import turn_prompt as turn_prompt
from ._results import AgentRow as AgentRow
from ._results import ColdReference as ColdReference
from ._results import ContextRecord as ContextRecord
from ._results import Event as Event
from ._results import Footprint as Footprint
from ._results import PathSummary as PathSummary
from ._results import PhaseStarted as PhaseStarted
from ._results import Results as Results
from ._results import RunStarted as RunStarted
from ._results import Savings as Savings
from ._results import Sharing as Sharing
from ._results import Summary as Summary
from ._results import TurnFinished as TurnFinished
from ._results import TurnRecord as TurnRecord
from ._results import TurnStarted as TurnStarted
from ._results import cold_model as cold_model
from ._results import load_results as load_results
from ._results import summarize as summarize
from ._results import turn_path as turn_path
from ._results import write_results as write_results
from ._run import run_scenario as run_scenario
from ._shipped import resolve_scenario as resolve_scenario
from ._shipped import run_scenarios as run_scenarios
from ._shipped import shipped_scenario as shipped_scenario
from ._view import WIDTH as WIDTH
from ._view import LiveView as LiveView
from ._view import format_summary as format_summary

__all__ = (
    "CONTEXT_AGENT",
    "NO_OUTPUTS",
    "PLACEHOLDERS",
    "POLICIES",
    "AgentRow",
    "AgentSpec",
    "ColdReference",
    "ContextRecord",
    "ContextSpec",
    "Event",
    "Footprint",
    "PathSummary",
    "PhaseSpec",
    "PhaseStarted",
    "Results",
    "RunStarted",
    "SamplingSpec",
    "Savings",
    "Scenario",
    "ScenarioError",
    "Sharing",
    "Summary",
    "TurnFinished",
    "TurnRecord",
    "TurnStarted",
    "cold_model",
    "estimate_budget",
    "estimate_context",
    "load_results",
    "load_scenario",
    "parse_scenario",
    "render",
    "resolve_model",
    "run_scenario",
    "scenario_cache_dir",
    "shared_text",
    "summarize",
    "turn_path",
    "turn_prompt",
    "write_results",
)
