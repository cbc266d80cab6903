"""The session API, once: what a session and its agents offer, whether they run in this
process (:class:`~kvactor.actors.session.Session`) or on engine hosts of a cluster
(:class:`~kvactor.actors.cluster.ClusterSession`).

:class:`SessionAPI`, :class:`AgentAPI` and :class:`TurnStream` are the protocols both
implement. :class:`AgentTurns` gives an agent class its six turn methods from one
``_turn_stream``: what differs between the two is only how a turn reaches its agent.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Generic, Literal, Protocol, TypeVar, get_args

from ..hot import make_hint
from ..ids import check_agent_id
from ..messages import Hint, MakeContext, SpawnAgent
from ..options import Sampling
from ..records import Completion, EngineStats, ToolCallDelta, ToolRequest
from ..tools import TOOL_OPTIONS, tool_request
from ..warm import Forgotten, PortableInfo

__all__ = (
    "AgentAPI",
    "AgentTurns",
    "SessionAPI",
    "TURN_KINDS",
    "TurnKind",
    "TurnStream",
    "drain",
    "prompt_text",
    "scope_name",
)

#: What a turn's payload is: a user message, a whole raw prompt, or a whole conversation.
TurnKind = Literal["text", "raw", "chat"]
TURN_KINDS: tuple[TurnKind, ...] = get_args(TurnKind)


def prompt_text(text: object) -> str:
    """``text``, checked to be a str (a prompt or a message). Raises TypeError."""
    if not isinstance(text, str):
        raise TypeError(f"the prompt must be a str, not {type(text).__name__}")
    return text


class TurnStream(Protocol):
    """A turn's text pieces as they are generated (``async for``), then ``completion``:
    the whole turn. Leaving early, or ``async with`` on the way out, cancels the turn.
    ``events()`` instead: the text pieces and, with tools, the tool calls' pieces
    (:class:`~kvactor.actors.protocol.ToolCallDelta`) as they form; iterate one or the
    other. Tool-call text is never among the text pieces."""

    completion: Completion | None

    def __aiter__(self) -> AsyncIterator[str]: ...
    def events(self) -> AsyncIterator[str | ToolCallDelta]: ...
    async def aclose(self) -> None: ...
    async def __aenter__(self) -> Any: ...
    async def __aexit__(self, *exc_info: object) -> None: ...


async def drain(stream: TurnStream) -> Completion:
    """The Completion of a turn's stream, its pieces read and dropped."""
    async with stream:
        async for _ in stream:
            pass
    assert stream.completion is not None
    return stream.completion


class AgentAPI(Protocol):
    """One agent: multi-turn generation with its cache kept between turns."""

    name: str

    def stream(self, text: str, **sampling: Any) -> TurnStream: ...
    def stream_raw(self, prompt: str, **sampling: Any) -> TurnStream: ...
    def stream_chat(self, messages: list[dict[str, Any]], **sampling: Any) -> TurnStream: ...
    def turn_stream(self, kind: TurnKind, payload: Any, **sampling: Any) -> TurnStream: ...
    async def generate(self, text: str, **sampling: Any) -> Completion: ...
    async def complete(self, prompt: str, **sampling: Any) -> Completion: ...
    async def chat(self, messages: list[dict[str, Any]], **sampling: Any) -> Completion: ...
    async def history(self) -> list[dict[str, Any]]: ...
    async def hint(
        self, *, expect_in_s: float | None = None, priority: int | None = None
    ) -> None: ...
    async def done(self) -> None: ...
    async def export(self, dest: Any) -> PortableInfo: ...


def scope_name(scope: object) -> str:
    """``scope``, checked: a str of at most 256 characters. Raises TypeError / ValueError."""
    if not isinstance(scope, str):
        raise TypeError(f"scope must be a str, not {type(scope).__name__}")
    if len(scope) > 256:
        raise ValueError("scope must have at most 256 characters")
    return scope


#: The agent handle a session gives out (``Agent`` here, ``ClusterAgent`` on a cluster).
AgentT = TypeVar("AgentT", bound=AgentAPI)


class SessionAPI(ABC, Generic[AgentT]):
    """A runtime of agents: spawn, find, fork and forget them, and advise its hot tier.

    Each operation is declared once, here, with the checks every session makes; a session
    in this process (:class:`~kvactor.actors.session.Session`) and one over a cluster
    (:class:`~kvactor.actors.cluster.ClusterSession`) implement what differs
    (``_spawn``, ``_context``, ``_hint``) and the rest of the protocol."""

    async def spawn_agent(
        self,
        name: str,
        *,
        system: str | None = None,
        fork_of: str | None = None,
        context: str | None = None,
        scope: str | None = None,
        tool_wait_s: float | None = None,
        model: str | None = None,
        host: str | None = None,
    ) -> AgentT:
        """A new agent called ``name`` (letters, digits, '.', '_', '-'); ``fork_of``: one
        that starts where that agent is (``fork``); ``context``: one whose system prompt
        is that shared context's text (see ``context``), so that its first turn reuses
        the context's cache instead of prefilling it. Give at most one of ``system``,
        ``fork_of`` and ``context``.

        ``scope``: the agents whose cached prefixes it shares (``share_prefixes``): only
        those of the same scope, so that what one scope (a tenant) caches never shows in
        another's turns. Default: its context's or fork source's scope, else ``""``.
        ``tool_wait_s``: how long its turns that end in tool calls keep its cache hot
        (default: the session's ``tool_wait_s``). ``model``: the model it runs (a name of
        ``models``; default: the first, or its fork source's or context's): forks and
        shared contexts stay within a model. ``host`` (a cluster): the engine host it runs
        on (default: its source's or context's, else where the placement policy says).

        Raises InvalidAgentId for an unsafe name, ValueError when it already exists, for
        more than one of those, or for a scope other than its context's or source's,
        TypeError when ``system`` or ``scope`` is not a str, UnknownAgent for a
        ``context`` this session has not made, ValueError for an unknown model or one
        other than the context's, for ``host`` in this process or an unknown one on a
        cluster, for ``model`` on a cluster (it serves one); with ``fork_of``, what
        ``fork`` raises.
        """
        if sum(x is not None for x in (system, fork_of, context)) > 1:
            raise ValueError("give at most one of system, fork_of and context")
        check_agent_id(name)
        for source in (fork_of, context):
            if source is not None:
                check_agent_id(source)
        if system is not None and not isinstance(system, str):
            raise TypeError(f"system must be a str or None, not {type(system).__name__}")
        if scope is not None:
            scope_name(scope)
        if tool_wait_s is not None and not 0 <= tool_wait_s <= 86_400:
            raise ValueError(f"tool_wait_s must be in [0, 86400], got {tool_wait_s}")
        spawn = SpawnAgent(
            name=name,
            system=system,
            fork_of=fork_of,
            context=context,
            scope=scope,
            tool_wait_s=tool_wait_s,
            model=model,
            host=host,
        )
        return await self._spawn(spawn)

    async def fork(
        self,
        source: str,
        name: str,
        *,
        scope: str | None = None,
        model: str | None = None,
        host: str | None = None,
    ) -> AgentT:
        """A new agent ``name`` that starts where agent ``source`` is now: its conversation
        and its cache, without copying it. In memory the stored arrays are shared (the hot
        budget counts them once); on disk ``name``'s folder gets hard links
        to ``source``'s segment files (one copy of the bytes) and a manifest of its own.
        From then on each goes its own way: neither ever sees the other's later tokens,
        and forgetting one leaves the other whole. It is of ``source``'s scope (a source
        on disk only: ``scope``, default ``""``), runs ``source``'s model (a source on
        disk only: ``model``, default the first: ValueError for another model) and, on a
        cluster, on ``source``'s host (ValueError for another ``host``).

        The source is asked between its turns (a turn it is taking finishes first). Raises
        InvalidAgentId for unsafe names, ValueError when ``name`` exists (running or on
        disk), UnknownAgent when ``source`` is neither running nor on disk.
        """
        return await self.spawn_agent(name, fork_of=source, scope=scope, model=model, host=host)

    async def context(
        self,
        name: str,
        text: str,
        *,
        scope: str = "",
        model: str | None = None,
        host: str | None = None,
    ) -> AgentT:
        """A shared context called ``name``: an agent whose cache holds ``text`` as a
        system prompt (as the chat template renders it) and nothing else, prefilled once
        now (resumed from the warm tier when it is there). Agents spawned with
        ``context=name`` start from its cache: their first turn shares its stored arrays
        (one copy in the hot budget) instead of prefilling the text, and their first
        write links its segment files (one copy on disk). Any agent whose prompt begins
        with the same tokens shares them too (``share_prefixes``). Forget it like an
        agent: the agents that share it keep what they use.

        Calling it again with the same text returns the context (its cache made hot
        again if it was demoted). Only agents of its ``scope`` and ``model`` (default: the
        first) share it (``spawn_agent``); on a cluster it lives on ``host`` (default:
        where the placement policy says) and its agents go there too.
        Raises InvalidAgentId for an unsafe name, ValueError for an empty text or a name
        that is an agent with another system prompt or scope, TypeError when ``text`` is
        not a str.
        """
        check_agent_id(name)
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, not {type(text).__name__}")
        if not text.strip():
            raise ValueError("a shared context needs some text")
        made = MakeContext(name=name, text=text, scope=scope_name(scope), model=model, host=host)
        return await self._context(made)

    async def hint(
        self,
        next: Sequence[str] = (),
        *,
        expect_in_s: Mapping[str, float] | None = None,
        priority: Mapping[str, int] | None = None,
        done: Sequence[str] = (),
        prefetch: int = 2,
    ) -> None:
        """Advice for the hot tier (docs: memory-policy): ``next``, the agents that run
        next, soonest first; ``expect_in_s``, seconds until an agent's next turn;
        ``priority``, higher stays hot longer; ``done``, agents done for now (demoted
        first). The first ``prefetch`` agents of ``next`` are staged from the warm tier.
        Wrong or missing hints cost time, never change an answer. Raises what
        :func:`~kvactor.actors.hot.make_hint` raises, ValueError for a negative
        ``prefetch``."""
        hint = make_hint(next, expect_in_s=expect_in_s, priority=priority, done=done)
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        await self._hint(hint, prefetch)

    @abstractmethod
    async def export_agent(self, name: str, dest: Any) -> PortableInfo:
        """Write agent ``name``'s cache as one portable file (docs: moving-agents) to
        ``dest``: a path (written whole or not at all: a temp file renamed at the end) or
        a binary file object (a pipe, a socket, ``sys.stdout.buffer``). It holds the
        agent's manifest (conversation, tokens) and every segment file, a fork's shared
        ones included, with the model and tokenizer fingerprint, codec and format, every
        byte checksummed. A running agent is asked between its turns. Raises UnknownAgent
        when it has no warm cache, StoreWriteError when its last turns are not on disk
        (their write failed: the export would lose them), CacheRejected when a file on
        disk fails its checksum, ValueError without a warm tier."""

    @abstractmethod
    async def import_agent(
        self,
        src: Any,
        name: str | None = None,
        *,
        replace: bool = False,
        model: str | None = None,
        scope: str | None = None,
        max_bytes: int = ...,
    ) -> AgentT:
        """The agent of a portable file (``export_agent``), resumed here warm: ``src`` is a
        path, the bytes, a binary file object or an async iterable of byte pieces (read as
        a stream: no copy of the whole). ``name``: the agent's name here (default: the
        one it was exported under); ``replace``: replace an agent of that name (else
        ValueError), atomically; ``model``, ``scope``: as ``spawn_agent``'s;
        ``max_bytes``: the most bytes of cache it takes. The file is verified as a warm
        load verifies a cache (checksums, identity, headers, shapes) before the agent
        exists. Raises CacheRejected with the reason (another model, tokenizer or
        codec, a newer format, a truncated or altered file, a header that lies, a cache
        past the disk limit, its quota or the hot budget) and StoreWriteError (no room
        can be made under the disk limit): nothing of a refused import stays."""

    @abstractmethod
    async def _spawn(self, spawn: SpawnAgent) -> AgentT:
        """Make the agent ``spawn`` asks for (checked as ``spawn_agent`` checks it)."""

    @abstractmethod
    async def _context(self, made: MakeContext) -> AgentT:
        """Make (or find again) the shared context ``made`` asks for (checked)."""

    @abstractmethod
    async def _hint(self, hint: Hint, prefetch: int) -> None:
        """Send the checked ``hint`` to the hot tiers holding its agents."""

    @abstractmethod
    def agent(self, name: str) -> AgentT:
        """The agent called ``name``; raises UnknownAgent."""

    @property
    @abstractmethod
    def agents(self) -> dict[str, AgentT]:
        """The agents running now, by name."""

    @abstractmethod
    async def forget(self, name: str) -> Forgotten:
        """Delete every byte of agent ``name`` that is its own (hot and warm)."""

    @abstractmethod
    async def prefetch(self, name: str) -> None:
        """Stage agent ``name``'s warm cache into the hot tier ahead of its turn."""

    @abstractmethod
    async def stats(self) -> EngineStats | Any:
        """The session's figures."""

    @abstractmethod
    async def end_turns(self) -> int:
        """End every turn, for a close to come; how many it ended."""

    @abstractmethod
    async def aclose(self) -> None:
        """Close the session (every agent saves its last turn first)."""

    async def __aenter__(self) -> Any:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


class AgentTurns(ABC):
    """The turn methods of :class:`AgentAPI`, all from :meth:`_turn_stream`."""

    name: str

    @abstractmethod
    def _turn_stream(
        self,
        kind: TurnKind,
        payload: Any,
        sampling: dict[str, Any],
        *,
        pieces: bool,
        tools: ToolRequest | None = None,
    ) -> TurnStream:
        """A turn of ``kind`` on ``payload`` (checked: a str, or a conversation), options
        checked (``Sampling.from_options``), its tool options made one ``tools`` (None:
        none). Without ``pieces`` only the Completion is needed (a whole turn): an
        implementation may skip sending each piece."""

    def turn_stream(self, kind: TurnKind, payload: Any, **sampling: Any) -> TurnStream:
        """Stream a turn of ``kind``: ``"text"`` (``stream``), ``"raw"`` (``stream_raw``),
        ``"chat"`` (``stream_chat``). Raises ValueError for another kind."""
        if kind not in TURN_KINDS:
            raise ValueError(f"kind must be one of {TURN_KINDS}, not {kind!r}")
        return self._checked(kind, payload, sampling, pieces=True)

    def _checked(
        self, kind: TurnKind, payload: Any, sampling: dict[str, Any], *, pieces: bool
    ) -> TurnStream:
        if kind != "chat":
            prompt_text(payload)
        options = {k: sampling.pop(k) for k in TOOL_OPTIONS if k in sampling}
        tools = tool_request(**options)  # bad options fail here, before anything runs
        if tools is not None and kind == "raw":
            raise ValueError("a raw prompt takes no tools or response_format (use chat)")
        Sampling.from_options(sampling)
        return self._turn_stream(kind, payload, sampling, pieces=pieces, tools=tools)

    def stream(self, text: str, **sampling: Any) -> TurnStream:
        """Stream the reply to the user message ``text``. Raises TypeError / ValueError for
        a prompt that is not a str or bad options."""
        return self._checked("text", text, sampling, pieces=True)

    def stream_raw(self, prompt: str, **sampling: Any) -> TurnStream:
        """Stream a completion of the whole raw ``prompt`` (no chat template, no history).

        A prompt that extends the previous one (plus what was generated) reuses the cache."""
        return self._checked("raw", prompt, sampling, pieces=True)

    def stream_chat(self, messages: list[dict[str, Any]], **sampling: Any) -> TurnStream:
        """Stream the reply to a whole conversation kept by the caller (``[{"role",
        "content"}, ...]``, ending with the user's message or a tool's result), as an HTTP
        client resends it every turn: it replaces the agent's history, and whatever of it
        the cache already spells is reused (prefix matching: a resent history plus a new
        message is an EXTEND). Assistant messages may hold ``tool_calls`` and ``tool``
        messages their results (``tool_call_id``): a tool loop's next turn EXTENDs.

        Tool options (besides the sampling options): ``tools`` (OpenAI or Anthropic tool
        definitions, Python functions with type hints, pydantic models), ``tool_choice``
        (``"auto"`` (default with tools), ``"none"``, ``"required"`` / Anthropic's
        ``{"type": "any"}``, or one function: ``{"type": "function", "function": {"name":
        ...}}`` / ``{"type": "tool", "name": ...}``), ``parallel_tool_calls`` (default
        True) and ``response_format`` (``{"type": "json_object"}``, ``{"type":
        "json_schema", "json_schema": {"schema": ...}}``, a JSON schema, a pydantic model,
        a ``Constraint``). A required or named choice and a response format constrain
        sampling (a grammar), so the calls and the answer always parse and validate. The
        Completion's ``tool_calls`` hold the calls (finish_reason TOOL_CALLS), its text
        what the model said besides. Raises ValueError / TypeError for a malformed
        conversation or options, ValueError for a schema the grammar engine refuses."""
        return self._checked("chat", messages, sampling, pieces=True)

    async def generate(self, text: str, **sampling: Any) -> Completion:
        """The whole reply to ``text``.

        Sampling options: max_tokens, temperature (0 = greedy), top_p, top_k, min_p, seed,
        stop, repetition_penalty, repetition_context_size, presence_penalty,
        frequency_penalty, logit_bias (see ``Sampling``); the tool options of
        ``stream_chat`` too (their results then come back through ``chat``).
        Raises TypeError for an unknown option, ValueError for an empty prompt or a bad
        value, ContextOverflow when the prompt does not fit the model; with
        ``on_save_error="raise"``, StoreWriteError (holding the ``completion``) when the
        turn's cache could not be written to the warm tier.
        """
        return await drain(self._checked("text", text, sampling, pieces=False))

    async def complete(self, prompt: str, **sampling: Any) -> Completion:
        """The completion of the raw ``prompt``; see ``stream_raw`` and ``generate``."""
        return await drain(self._checked("raw", prompt, sampling, pieces=False))

    async def chat(self, messages: list[dict[str, Any]], **sampling: Any) -> Completion:
        """The whole reply to a conversation kept by the caller; see ``stream_chat``."""
        return await drain(self._checked("chat", messages, sampling, pieces=False))

    @abstractmethod
    async def history(self) -> list[dict[str, Any]]:
        """The agent's conversation so far."""
