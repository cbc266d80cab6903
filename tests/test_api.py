"""The public API: what ``kvactor`` exports, one error hierarchy, str-valued enums."""

from __future__ import annotations

import json
from typing import Any

import msgspec

import kvactor
import kvactor.actors as actors
import kvactor.runtime as runtime
from kvactor.actors.enums import FinishReason, Match, Room, StageOutcome, Tier, TurnPath


def test_kvactor_exports_the_application_api_once() -> None:
    names = kvactor.__all__
    assert len(set(names)) == len(names)
    for name in names:
        assert getattr(kvactor, name) is not None, name
    for needed in ("open", "Session", "Agent", "Completion", "TextStream", "Sampling"):
        assert needed in names
    for needed in ("EvictionPolicy", "LRUPolicy", "Candidate", "Attention", "KVCodec"):
        assert needed in names  # what open() accepts
    # The actor kernel and internals are not part of it.
    for internal in ("Actor", "ThreadActor", "Runtime", "ActorRef", "Reply", "EngineActor"):
        assert internal not in names
    for internal in ("LoadedModel", "ensure_blas", "CachePool", "EngineConfig", "Room"):
        assert internal not in names
    assert not hasattr(kvactor, "Runtime")


def test_each_layer_exports_its_names_once() -> None:
    for module in (runtime, actors):
        assert len(set(module.__all__)) == len(module.__all__)
        for name in module.__all__:
            assert hasattr(module, name), (module.__name__, name)


def test_every_error_shares_one_root() -> None:
    errors = [
        obj
        for module in (kvactor, runtime, actors)
        for obj in (getattr(module, n) for n in module.__all__)
        if isinstance(obj, type) and issubclass(obj, Exception)
    ]
    assert len(errors) > 12
    for error in errors:
        assert issubclass(error, kvactor.KvactorError), error
    assert runtime.ActorError.__mro__[1] is kvactor.KvactorError
    assert issubclass(kvactor.ModelLoadError, kvactor.KvactorError)


def test_enums_print_compare_and_serialize_as_their_values() -> None:
    for enum in (Tier, Match, FinishReason, Room, StageOutcome, TurnPath):
        for member in enum:
            assert member == member.value
            assert str(member) == f"{member}" == member.value
            assert json.loads(msgspec.json.encode(member)) == member.value
            assert msgspec.json.decode(msgspec.json.encode(member), type=enum) is member
    assert StageOutcome.STAGED.hot and StageOutcome.HOT.hot and not StageOutcome.NO_ROOM.hot


def _sessions_implement_one_api(
    local: kvactor.Session,
    cluster: kvactor.ClusterSession,
    agent: kvactor.Agent,
    remote: kvactor.actors.cluster.ClusterAgent,
) -> tuple[kvactor.SessionAPI[Any], kvactor.SessionAPI[Any], kvactor.AgentAPI, kvactor.AgentAPI]:
    """Checked by mypy (tools/typecheck.py): both sessions and both agents have the API."""
    return local, cluster, agent, remote


def test_in_process_and_cluster_agents_share_their_turn_methods() -> None:
    from kvactor.actors.cluster import ClusterAgent
    from kvactor.actors.session import AgentTurns

    for cls in (kvactor.Agent, ClusterAgent):
        assert issubclass(cls, AgentTurns)
        for name in ("stream", "stream_raw", "stream_chat", "generate", "complete", "chat"):
            assert getattr(cls, name) is getattr(AgentTurns, name)  # written once


def test_spawn_fork_context_and_hint_are_declared_once_for_both_sessions() -> None:
    """One declaration per operation: both sessions inherit SessionAPI's, so their
    signatures cannot drift; the parts that differ are the abstract _spawn & co."""
    import inspect

    from kvactor.actors.cluster import EngineHost
    from kvactor.actors.messages import MakeContext, SpawnAgent

    operations = ("spawn_agent", "fork", "context", "hint")
    for cls in (kvactor.Session, kvactor.ClusterSession):
        assert issubclass(cls, kvactor.SessionAPI)
        for name in operations:
            assert getattr(cls, name) is getattr(kvactor.SessionAPI, name), (cls, name)
    local, cluster = (
        {n: inspect.signature(getattr(cls, n)) for n in operations}
        for cls in (kvactor.Session, kvactor.ClusterSession)
    )
    assert local == cluster
    # What spawn_agent and context take is what a host is sent: every keyword, typed.
    spawn = inspect.signature(kvactor.SessionAPI.spawn_agent).parameters
    assert set(spawn) - {"self"} == set(SpawnAgent.__struct_fields__)
    made = inspect.signature(kvactor.SessionAPI.context).parameters
    assert set(made) - {"self"} == set(MakeContext.__struct_fields__)
    host = inspect.signature(EngineHost.spawn).parameters
    assert [p.annotation for p in host.values()][1:] == ["SpawnAgent"]
