"""Calls from a cluster's front to its engine hosts through Ray, a part of
:class:`~kvactor.actors.cluster.ClusterSession`: each call's error as the caller should see
it, waiting for a host Ray is restarting, and the hand-over of a host gone for good."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from ..errors import HostLost, UnknownAgent
from ..ids import check_agent_id

__all__ = ("RESTART_WAIT_S", "Host", "HostCalls", "NoReturn", "unwrap")

#: How long a call waits for a host that Ray is restarting.
RESTART_WAIT_S = 60.0


class NoReturn(HostLost):
    """A host stayed unavailable for RESTART_WAIT_S."""


@dataclass
class Host:
    """An engine host as the front knows it: its name, Ray handle and node."""

    name: str
    handle: Any  # a Ray ActorHandle of EngineHost
    node: str


def unwrap(exc: BaseException, host: str) -> BaseException:
    """The error a caller should see for what a Ray call raised."""
    from ray.exceptions import RayActorError, RayTaskError

    if isinstance(exc, RayTaskError) and isinstance(getattr(exc, "cause", None), BaseException):
        cause: BaseException = exc.cause
        return cause
    if isinstance(exc, RayActorError):
        return HostLost(
            f"engine host {host!r} died during the call ({type(exc).__name__}); Ray restarts "
            "it, and its agents resume from their warm caches on their next call"
        )
    return exc


class HostCalls:
    """ClusterSession's calls to its hosts (its state, declared in its ``__init__``)."""

    _hosts: dict[str, Host]
    _where: dict[str, str]  # agent -> host
    _lost: set[str]  # hosts gone for good

    if TYPE_CHECKING:  # ClusterSession's

        async def _host_gone(self, host: Host) -> str: ...

    # -- calls ------------------------------------------------------------------------
    async def _call(self, host: Host, method: str, *args: Any) -> Any:
        """``host.method(*args)`` through Ray, its error as the caller should see it; waits
        for a host that Ray is restarting, and hands the agents of one gone for good to
        their replicas' hosts."""
        try:
            return await self._call_raw(host, method, *args)
        except Exception as exc:
            raise await self._error(exc, host) from None

    async def _call_raw(self, host: Host, method: str, *args: Any) -> Any:
        import ray
        from ray.exceptions import ActorUnavailableError

        if host.name in self._lost:
            raise HostLost(f"engine host {host.name!r} is gone")
        deadline = time.monotonic() + RESTART_WAIT_S
        while True:
            ref = getattr(host.handle, method).remote(*args)
            try:
                return await anyio.to_thread.run_sync(ray.get, ref, abandon_on_cancel=True)
            except ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise NoReturn(f"engine host {host.name!r} did not come back") from None
                await anyio.sleep(0.2)

    async def _error(self, exc: BaseException, host: Host) -> BaseException:
        """What a caller sees for ``exc`` from ``host``. A host that Ray says is dead for
        good (a call to it fails so again; a host being restarted says it is unavailable)
        or that stayed unavailable is gone: its agents go to their replicas' hosts first."""
        from ray.exceptions import ActorDiedError

        if isinstance(exc, NoReturn) or (
            isinstance(exc, ActorDiedError) and not await self._alive(host)
        ):
            moved = await self._host_gone(host)
            return HostLost(f"engine host {host.name!r} is gone for good; {moved}")
        return unwrap(exc, host.name)

    async def _alive(self, host: Host) -> bool:
        """False when ``host`` is dead for good: calls to it keep failing with Ray's
        ActorDiedError. One that Ray restarts answers, says it is unavailable, or is slow
        (loading its model): all alive."""
        import ray
        from ray.exceptions import ActorDiedError

        if host.name in self._lost:
            return False
        for _ in range(3):  # a call can reach a host Ray has not yet seen die
            ref = host.handle.info.remote()
            try:
                await anyio.to_thread.run_sync(
                    functools.partial(ray.get, ref, timeout=5.0), abandon_on_cancel=True
                )
                return True
            except ActorDiedError:
                await anyio.sleep(0.5)
            except Exception:
                return True
        return False

    async def _next(self, host: Host, gen: Any, *, raw: bool = False) -> Any:
        """The next item of a streaming call (None at its end); ``raw`` lets Ray's
        ActorUnavailableError through for a caller that can send the call again."""
        import ray
        from ray.exceptions import ActorUnavailableError

        def step() -> Any:
            try:
                ref = next(gen)
            except StopIteration:
                return None
            return ray.get(ref)

        try:
            return await anyio.to_thread.run_sync(step, abandon_on_cancel=True)
        except Exception as exc:
            if raw and isinstance(exc, ActorUnavailableError):
                raise
            raise await self._error(exc, host) from None

    def _host_of(self, agent: str) -> Host:
        check_agent_id(agent)
        try:
            host = self._hosts[self._where[agent]]
        except KeyError:
            raise UnknownAgent(f"no agent named {agent!r} on any host") from None
        if host.name in self._lost:
            raise HostLost(
                f"agent {agent!r} was on engine host {host.name!r}, which is gone, and had "
                "no replica (replicas=2 keeps one on another host)"
            )
        return host

    def _host(self, name: str) -> Host:
        if name in self._lost:
            raise ValueError(f"host {name!r} is gone")
        try:
            return self._hosts[name]
        except KeyError:
            raise ValueError(f"no host named {name!r} (hosts: {sorted(self._hosts)})") from None
