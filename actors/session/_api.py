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
from typing import Any, Literal, Protocol, get_args

from ..options import Sampling
from ..records import Completion, EngineStats, ToolCallDelta, ToolRequest
from ..tools import TOOL_OPTIONS, tool_request
from ..warm import Forgotten

__all__ = (
    "AgentAPI",
    "AgentTurns",
    "SessionAPI",
    "TURN_KINDS",
    "TurnKind",
    "TurnStream",
    "drain",
    "prompt_text",
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


class SessionAPI(Protocol):
    """A runtime of agents over one model: spawn, find, fork and forget them."""

    async def spawn_agent(
        self,
        name: str,
        *,
        system: str | None = None,
        fork_of: str | None = None,
        context: str | None = None,
        scope: str | None = None,
    ) -> AgentAPI: ...
    async def context(self, name: str, text: str, *, scope: str = "") -> AgentAPI: ...
    async def fork(self, source: str, name: str, *, scope: str | None = None) -> AgentAPI: ...
    def agent(self, name: str) -> AgentAPI: ...
    @property
    def agents(self) -> dict[str, Any]: ...
    async def forget(self, name: str) -> Forgotten: ...
    async def prefetch(self, name: str) -> None: ...
    async def hint(
        self,
        next: Sequence[str] = (),
        *,
        expect_in_s: Mapping[str, float] | None = None,
        priority: Mapping[str, int] | None = None,
        done: Sequence[str] = (),
        prefetch: int = 2,
    ) -> None: ...
    async def stats(self) -> EngineStats | Any: ...
    async def end_turns(self) -> int: ...
    async def aclose(self) -> None: ...
    async def __aenter__(self) -> Any: ...
    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


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
