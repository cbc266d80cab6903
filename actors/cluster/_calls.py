"""A cluster's engine hosts as its front knows them, and the calls to them through Ray: a
call names an :class:`~kvactor.actors.cluster.EngineHost` method (a method reference, so
that mypy checks its arguments and answer), its error comes back as the caller should see
it, a host Ray is restarting is waited for, and one gone for good is handed over."""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

import anyio

from ..errors import HostLost
from ._host import EngineHost

__all__ = ("RESTART_WAIT_S", "Host", "Hosts", "NoReturn", "unwrap")

#: How long a call waits for a host that Ray is restarting.
RESTART_WAIT_S = 60.0

P = ParamSpec("P")
R = TypeVar("R")


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


class Hosts:
    """The engine hosts of a cluster session (a part of the ``ClusterSession``) and every
    call to them. ``on_gone``: what to do with a host gone for good (hand its agents to
    their replicas' hosts); it says where they went.

    Invariant: the only writer of the hosts and of which of them are gone for good."""

    def __init__(self, on_gone: Callable[[Host], Awaitable[str]]) -> None:
        self._hosts: dict[str, Host] = {}
        self._lost: set[str] = set()  # hosts gone for good
        self._on_gone = on_gone

    # -- the hosts --------------------------------------------------------------------
    def add(self, host: Host) -> None:
        assert host.name not in self._hosts, f"host {host.name!r} twice"
        self._hosts[host.name] = host

    def __len__(self) -> int:
        return len(self._hosts)

    def __iter__(self) -> Iterator[Host]:
        return iter(list(self._hosts.values()))

    def live(self) -> list[Host]:
        return [h for h in self._hosts.values() if h.name not in self._lost]

    def lost(self, name: str) -> bool:
        return name in self._lost

    @property
    def lost_names(self) -> list[str]:
        return sorted(self._lost)

    def mark_lost(self, name: str) -> bool:
        """Mark host ``name`` gone for good; False when it was already."""
        if name in self._lost:
            return False
        self._lost.add(name)
        return True

    def get(self, name: str) -> Host:
        """Host ``name``, live. Raises ValueError for one gone or unknown."""
        if name in self._lost:
            raise ValueError(f"host {name!r} is gone")
        try:
            return self._hosts[name]
        except KeyError:
            raise ValueError(f"no host named {name!r} (hosts: {sorted(self._hosts)})") from None

    def any(self, name: str) -> Host:
        """Host ``name``, live or gone. Raises KeyError for an unknown one."""
        return self._hosts[name]

    # -- calls ------------------------------------------------------------------------
    async def call(
        self,
        host: Host,
        method: Callable[Concatenate[EngineHost, P], Awaitable[R]],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> R:
        """``host.method(*args)`` through Ray, its error as the caller should see it; waits
        for a host that Ray is restarting, and hands the agents of one gone for good to
        their replicas' hosts."""
        try:
            return await self._call_raw(host, method.__name__, args, kwargs)
        except Exception as exc:
            raise await self._error(exc, host) from None

    def remote(
        self,
        host: Host,
        method: Callable[Concatenate[EngineHost, P], Awaitable[Any]],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> Any:
        """Start ``host.method(*args)`` and return its Ray ObjectRef at once (its answer
        stays in the object store: another host can take it as an argument)."""
        return getattr(host.handle, method.__name__).remote(*args, **kwargs)

    def stream(
        self,
        host: Host,
        method: Callable[Concatenate[EngineHost, P], AsyncIterator[Any]],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> Any:
        """Start the streaming ``host.method(*args)``: Ray's generator of its items' refs
        (read them with :meth:`next`)."""
        call = getattr(host.handle, method.__name__).options(num_returns="streaming")
        return call.remote(*args, **kwargs)

    async def _call_raw(
        self, host: Host, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        import ray
        from ray.exceptions import ActorUnavailableError

        if host.name in self._lost:
            raise HostLost(f"engine host {host.name!r} is gone")
        deadline = time.monotonic() + RESTART_WAIT_S
        while True:
            ref = getattr(host.handle, method).remote(*args, **kwargs)
            try:
                return await anyio.to_thread.run_sync(ray.get, ref, abandon_on_cancel=True)
            except ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise NoReturn(f"engine host {host.name!r} did not come back") from None
                await anyio.sleep(0.2)

    async def get_ref(self, host: Host, ref: Any) -> Any:
        """The answer of a call started with :meth:`remote`, its error as the caller
        should see it (a host lost meanwhile is not handed over here: the caller decides)."""
        import ray

        try:
            return await anyio.to_thread.run_sync(ray.get, ref)
        except Exception as exc:
            raise unwrap(exc, host.name) from None

    async def _error(self, exc: BaseException, host: Host) -> BaseException:
        """What a caller sees for ``exc`` from ``host``. A host that Ray says is dead for
        good (a call to it fails so again; a host being restarted says it is unavailable)
        or that stayed unavailable is gone: its agents go to their replicas' hosts first."""
        from ray.exceptions import ActorDiedError

        if isinstance(exc, NoReturn) or (
            isinstance(exc, ActorDiedError) and not await self._alive(host)
        ):
            moved = await self._on_gone(host)
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
            ref = self.remote(host, EngineHost.info)
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

    async def next(self, host: Host, gen: Any, *, raw: bool = False) -> Any:
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

    async def each(self, method: Callable[[EngineHost], Awaitable[R]]) -> list[R]:
        """``method``'s answer from every host still here, asked of all at once, in the
        hosts' order (one lost meanwhile is left out)."""
        return [answer for _, answer in await self.gather(lambda h: self.call(h, method))]

    async def gather(self, ask: Callable[[Host], Awaitable[R]]) -> list[tuple[Host, R]]:
        """``ask(host)`` of every live host at once, each answer with its host, in the
        hosts' order; a host lost meanwhile is left out. The first other error is raised
        as itself once every ask has ended."""
        live = self.live()
        answers: dict[str, R] = {}
        errors: list[Exception] = []

        async def one(host: Host) -> None:
            try:
                answers[host.name] = await ask(host)
            except HostLost as exc:
                if host.name not in self._lost:
                    errors.append(exc)
            except Exception as exc:  # raised as itself below, not in a group
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for host in live:
                tg.start_soon(one, host)
        if errors:
            raise errors[0]
        return [(h, answers[h.name]) for h in live if h.name in answers]
