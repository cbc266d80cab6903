"""More than one machine: engine hosts as Ray actors, agents placed and moved with their caches.

``kvactor.open(model, cluster="auto")`` (or :func:`open_cluster`) connects to a Ray cluster,
or starts a local one on 127.0.0.1, and starts one :class:`~kvactor.actors.host.EngineHost`
per node (``hosts_per_node`` for more): a Ray actor that owns MLX on its node, runs a kvactor
session there and keeps that node's warm tier under ``<cache_dir>/hosts/<host>`` on its
local disk. The :class:`ClusterSession` it returns has the ``Session`` API (spawn, agents and
their turns, forget, prefetch, stats) plus :meth:`ClusterSession.place` and
:meth:`ClusterSession.rebalance`. Ray is imported here only: an application that never asks
for a cluster never imports it.

- **Placement**: a new agent goes where its ``PlacementPolicy`` says (default
  :class:`CacheAware`: the host that holds the longest prefix of its prompt, unless that
  host is past its share of the agents; hosts tell the front what they hold as block
  hashes, with each turn's result); forks and agents of a shared context go to their
  source's host;
  an agent stays where its cache is (a session that connects again finds each agent on the
  host whose disk holds it).
- **Migration** (``place``): the old host releases the agent (its last turn saved) and hands
  its committed warm files to the new host through Ray's object store (host to host, not via
  the caller); the new host verifies them as a warm load does before it moves them into
  place; only then does the old host forget them. A migration that fails leaves the agent
  where it was, whole.
- **Failures**: a host process that dies fails its pending turns at once with
  :class:`HostLost`; Ray restarts it, and its agents resume from their warm caches on the
  next call (the disk is the node's own), while agents on other hosts never notice.
- **Replicas** (``replicas=2``): after each turn the agent's new warm files go to a second
  host (another node first), which verifies them as a warm load does (kept segments whose
  manifest entry is unchanged are only checked to be there) before it swaps the replica in. A
  host gone for good (Ray says it is dead, and a call to it fails so again) hands each of
  its agents with a replica to the replica's host, which verifies and resumes it there.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import anyio

from ..engine import ModelSpec
from ..errors import AgentExists, HostLost, UnknownAgent
from ..hot import split_hint
from ..ids import check_agent_id
from ..messages import Hint, MakeContext, SpawnAgent
from ..session import Opening, OpenOptions, SessionAPI, read_source, write_bytes
from ..warm import MAX_IMPORT_BYTES, Forgotten, PortableInfo, read_header
from ._agent import ClusterAgent
from ._calls import Host, Hosts
from ._connect import connect, loopback_before_import
from ._host import EngineHost, HostInfo
from ._placement import CacheAware, ClusterStats, Migration, PlacementPolicy, PrefixPlacement
from ._prefixes import HeldPrefixes

__all__ = ("CLUSTER_KEYS", "ClusterOptions", "ClusterSession", "open_cluster")

log = logging.getLogger("kvactor.cluster")


class ClusterOptions(OpenOptions, total=False):
    """``kvactor.open``'s keywords with ``cluster=``: each host's, plus the cluster's own
    (``kvactor.actors.cluster.open_cluster``)."""

    hosts_per_node: int
    placement: PlacementPolicy | None
    ray_options: dict[str, Any] | None
    replicas: int


#: The keywords only a cluster takes.
CLUSTER_KEYS = tuple(
    k for k in ClusterOptions.__annotations__ if k not in OpenOptions.__annotations__
)


class ClusterSession(SessionAPI[ClusterAgent]):
    """Agents on several engine hosts (see the module doc). Use ``open_cluster`` or
    ``kvactor.open(..., cluster=...)``."""

    def __init__(
        self,
        model: ModelSpec,
        cluster: str,
        cache_dir: str | os.PathLike[str],
        *,
        hosts_per_node: int = 1,
        placement: PlacementPolicy | None = None,
        ray_options: dict[str, Any] | None = None,
        options: dict[str, Any] | None = None,
        replicas: int = 1,
    ) -> None:
        if hosts_per_node < 1:
            raise ValueError("hosts_per_node must be >= 1")
        if replicas not in (1, 2):
            raise ValueError("replicas must be 1 (each cache on its host only) or 2")
        self._model = model
        self._cluster = cluster
        self.cache_dir = Path(cache_dir)
        self._hosts_per_node = hosts_per_node
        self.placement: PlacementPolicy = placement or CacheAware()
        self.prefixes = HeldPrefixes()  # what each host holds (CacheAware reads it)
        self._ray_options = dict(ray_options or {})
        self._options = dict(options or {})
        self.engine_hosts = Hosts(self._host_gone)
        self._where: dict[str, str] = {}  # agent -> host
        self._migrations: list[Migration] = []
        self.replicas = replicas
        self._replica: dict[str, str] = {}  # agent -> the host that keeps its replica
        self._failover = anyio.Lock()
        self._replication_failures = 0
        self._started_ray = False
        self._closed = False

    # -- start and stop ---------------------------------------------------------------
    async def start(self) -> ClusterSession:
        """Connect to Ray (or start it), start the hosts, find the agents on their disks.
        Connecting blocks the event loop for the seconds it takes (Ray wants the main
        thread for its signal handlers); the hosts start in the background."""
        self._start_hosts()
        try:
            if self.replicas > len(self.engine_hosts):
                raise ValueError(f"replicas={self.replicas} needs as many hosts")
            infos = await self.hosts()
            for info in infos:
                for agent in info.warm_agents:
                    self._where.setdefault(agent, info.name)
            helds = await self.engine_hosts.each(EngineHost.held_blocks)
            for info, held in zip(infos, helds, strict=True):
                for agent, blocks in held.items():
                    if self._where.get(agent) == info.name:
                        self.prefixes.update(info.name, agent, blocks)
            for info in infos:
                for agent in info.replicas:
                    if self._where.get(agent, info.name) != info.name:
                        self._replica.setdefault(agent, info.name)
        except BaseException:
            await self.aclose()
            raise
        return self

    def _start_hosts(self) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if not ray.is_initialized():
            self._started_ray = connect(self._cluster, self._ray_options)
        nodes = sorted(
            (n for n in ray.nodes() if n.get("Alive")), key=lambda n: str(n.get("NodeID"))
        )
        remote = ray.remote(EngineHost)
        for node in nodes:
            cpus = max(1, int(node.get("Resources", {}).get("CPU", 1)) // self._hosts_per_node)
            for _ in range(self._hosts_per_node):
                name = f"h{len(self.engine_hosts)}"
                handle = remote.options(
                    num_cpus=cpus,
                    max_restarts=-1,
                    max_task_retries=0,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False),
                ).remote(
                    name,
                    self._model,
                    str(self.cache_dir / "hosts" / name),
                    self._options,
                    str(node["NodeID"]),
                    self._hosts_per_node,
                )
                self.engine_hosts.add(Host(name, handle, str(node["NodeID"])))
        if not len(self.engine_hosts):
            raise RuntimeError("the Ray cluster has no live node")

    async def aclose(self) -> None:
        """Close every host (each agent saves its last turn), stop them, and stop Ray if
        this session started it. Closing twice does nothing."""
        if self._closed:
            return
        self._closed = True
        import ray

        for host in self.engine_hosts:
            try:
                await self.engine_hosts.call(host, EngineHost.close)
            except Exception:  # a host that is gone has nothing left to save
                pass
            ray.kill(host.handle)
        if self._started_ray:
            await anyio.to_thread.run_sync(ray.shutdown)

    # -- replicas and lost hosts ------------------------------------------------------
    async def replicate(self, agent: str) -> None:
        """With ``replicas=2``: bring the replica of ``agent``'s warm cache on another host
        up to date (its new files only, host to host), after each of its turns. A failure
        is logged and counted (``stats().replication_failures``), never the turn's."""
        if self.replicas < 2 or agent not in self._where:
            return
        hosts = self.engine_hosts
        home = hosts.any(self._where[agent])
        holder = self._replica.get(agent)
        try:
            if holder is None or hosts.lost(holder):
                others = [h for h in hosts.live() if h is not home]
                if not others:
                    return
                counts = {h.name: 0 for h in others}
                for held in self._replica.values():
                    if held in counts:
                        counts[held] += 1
                # Another node first (a replica on the same node survives no node loss).
                best = min(others, key=lambda h: (h.node == home.node, counts[h.name], h.name))
                holder = best.name
            have = await hosts.call(hosts.any(holder), EngineHost.replica_files, agent)
            update = hosts.remote(home, EngineHost.files, agent, have)  # host to host
            await hosts.call(hosts.any(holder), EngineHost.keep_replica, agent, update)
            self._replica[agent] = holder
        except Exception as exc:  # the turn is done and saved on its host
            self._replication_failures += 1
            log.warning("replica of agent %r on host %r not updated: %s", agent, holder, exc)

    async def _drop_replica(self, agent: str) -> None:
        holder = self._replica.pop(agent, None)
        if holder is not None and not self.engine_hosts.lost(holder):
            try:
                await self.engine_hosts.call(
                    self.engine_hosts.any(holder), EngineHost.drop_replica, agent
                )
            except Exception as exc:  # a stale replica is never promoted over a live agent
                log.warning("replica of agent %r on host %r not deleted: %s", agent, holder, exc)

    async def _host_gone(self, host: Host) -> str:
        """Mark ``host`` gone for good; each of its agents with a replica becomes an agent
        of the replica's host (verified as a warm load, then resumed there). Says where
        they went."""
        async with self._failover:
            if not self.engine_hosts.mark_lost(host.name):
                return "its agents went where the first report said"
            moved, stranded = [], []
            for agent in sorted(a for a, h in self._where.items() if h == host.name):
                holder = self._replica.pop(agent, None)
                if holder is None or self.engine_hosts.lost(holder):
                    stranded.append(agent)
                    self.prefixes.drop(agent)
                    continue
                try:
                    await self.engine_hosts.call(
                        self.engine_hosts.any(holder), EngineHost.promote, agent
                    )
                except Exception as exc:
                    log.warning("replica of %r on %r not promoted: %s", agent, holder, exc)
                    stranded.append(agent)
                    continue
                self._where[agent] = holder
                self.prefixes.move(agent, holder)
                moved.append(f"{agent} -> {holder}")
            for agent, holder in list(self._replica.items()):
                if holder == host.name:
                    del self._replica[agent]  # made again on the agent's next turn
            said = f"agents resumed from their replicas: {', '.join(moved) or 'none'}"
            if stranded:
                said += f"; without a replica: {', '.join(stranded)}"
            log.warning("engine host %r is gone: %s", host.name, said)
            return said

    # -- the Session API --------------------------------------------------------------
    async def hosts(self) -> list[HostInfo]:
        """What every host says of itself, by name."""
        return await self.engine_hosts.each(EngineHost.info)

    async def _loads(self) -> list[HostInfo]:
        """What placement reads of every host (``EngineHost.load_info``: no manifest read)."""
        return await self.engine_hosts.each(EngineHost.load_info)

    async def stats(self) -> ClusterStats:
        return ClusterStats(
            hosts=await self.hosts(),
            migrations=list(self._migrations),
            lost_hosts=self.engine_hosts.lost_names,
            replication_failures=self._replication_failures,
        )

    async def _spawn(self, spawn: SpawnAgent) -> ClusterAgent:
        """A new agent (``SessionAPI.spawn_agent``) on ``spawn.host``, or where a fork's
        source or a shared context is, or where the placement policy says."""
        return await self._spawn_placed(spawn, spawn.system)

    async def spawn_placed(
        self, name: str, messages: list[dict[str, Any]], *, scope: str = ""
    ) -> ClusterAgent:
        """A new agent ``name`` (of sharing scope ``scope``) whose first turn will be the
        conversation ``messages``, on the host the placement policy picks for that prompt
        (``CacheAware``: the host holding the longest prefix of it, unless past its share
        of the agents). What a server does for a conversation it has not seen. Raises as
        ``spawn_agent`` does."""
        check_agent_id(name)
        if not isinstance(scope, str):
            raise TypeError(f"scope must be a str, not {type(scope).__name__}")
        return await self._spawn_placed(SpawnAgent(name=name, scope=scope), messages)

    async def _spawn_placed(
        self, spawn: SpawnAgent, prompt: str | list[dict[str, Any]] | None
    ) -> ClusterAgent:
        """``spawn`` placed by its source, its host, else by ``prompt`` (a system prompt,
        or a first turn's messages). An agent whose host is gone for good without a
        replica is spawned again (cold) where placement says."""
        name = spawn.name
        if spawn.model is not None:
            raise ValueError("a cluster session serves one model: no model=")
        if name in self._where:
            if not self.engine_hosts.lost(self._where[name]):
                raise AgentExists(f"agent {name!r} already exists (on host {self._where[name]!r})")
            del self._where[name]  # stranded with its host: it starts again, cold
        source = spawn.fork_of if spawn.fork_of is not None else spawn.context
        blocks: list[int] = []
        if source is not None:
            home = self.host_of(source)
            if spawn.host is not None and spawn.host != home.name:
                raise ValueError(f"{source!r} is on host {home.name!r}, not {spawn.host!r}")
            target = home
            blocks = self.prefixes.blocks_of(source)
        elif spawn.host is not None:
            target = self.engine_hosts.get(spawn.host)
        else:
            where, blocks = await self._choose(name, prompt)
            target = self.engine_hosts.get(where)
        await self.engine_hosts.call(target, EngineHost.spawn, spawn)
        self._where[name] = target.name
        if blocks:  # what it holds once its first turn ran: the next of its team follows
            self.prefixes.update(target.name, name, blocks)
        return ClusterAgent(self, name)

    async def _choose(
        self, agent: str, prompt: str | list[dict[str, Any]] | None
    ) -> tuple[str, list[int]]:
        """Where the placement policy puts a new ``agent`` whose prompt starts with
        ``prompt`` (a system prompt, or a first turn's messages), and that prompt's block
        hashes (empty unless the policy looks at prompts: one host renders and hashes it,
        the others are not asked; messages its chat template refuses: placed by load)."""
        infos = await self._loads()
        if not isinstance(self.placement, PrefixPlacement) or not prompt:
            return self.placement.choose(agent, infos), []
        any_host = self.engine_hosts.live()[0]
        try:
            blocks: list[int] = await self.engine_hosts.call(
                any_host, EngineHost.prompt_blocks, prompt
            )
        except HostLost:
            raise
        except Exception as exc:  # the turn itself says what is wrong with its messages
            log.debug("placing %r by load: its prompt does not render: %s", agent, exc)
            return self.placement.choose(agent, infos), []
        return self.placement.choose_prefix(agent, infos, blocks, self.prefixes), blocks

    async def _context(self, made: MakeContext) -> ClusterAgent:
        """A shared context (``SessionAPI.context``) on ``made.host`` or where placement
        says; its agents go to the same host."""
        if made.model is not None:
            raise ValueError("a cluster session serves one model: no model=")
        if made.name in self._where:
            raise AgentExists(f"agent {made.name!r} already exists")
        blocks: list[int] = []
        if made.host is not None:
            where = made.host
        else:
            where, blocks = await self._choose(made.name, made.text)
        target = self.engine_hosts.get(where)
        await self.engine_hosts.call(target, EngineHost.context, made)
        self._where[made.name] = target.name
        if blocks:
            self.prefixes.update(target.name, made.name, blocks)
        return ClusterAgent(self, made.name)

    def agent(self, name: str) -> ClusterAgent:
        """The agent called ``name``, on whichever host; raises UnknownAgent."""
        self.host_of(name)
        return ClusterAgent(self, name)

    @property
    def agents(self) -> dict[str, ClusterAgent]:
        """The agents on live hosts (one whose host is gone for good without a replica
        is not: ``agent`` says why, and spawning it again starts it cold elsewhere)."""
        lost = self.engine_hosts.lost
        return {name: ClusterAgent(self, name) for name, h in self._where.items() if not lost(h)}

    def where(self, name: str) -> str:
        """The host that serves agent ``name`` now. Raises UnknownAgent."""
        return self.host_of(name).name

    async def forget(self, name: str) -> Forgotten:
        """Delete every byte of the agent on its host (``Session.forget``)."""
        host = self.host_of(name)
        done = await self.engine_hosts.call(host, EngineHost.forget, name)
        del self._where[name]
        self.prefixes.drop(name)
        await self._drop_replica(name)
        return done

    async def export_agent(self, name: str, dest: Any) -> PortableInfo:
        """``Session.export_agent`` from the agent's host: the portable file comes here
        whole (through Ray's object store), then goes to ``dest``."""
        data: bytes = await self.engine_hosts.call(
            self.host_of(name), EngineHost.export_portable, name
        )
        header = await anyio.to_thread.run_sync(read_header, data)
        await anyio.to_thread.run_sync(write_bytes, data, dest)
        return PortableInfo(header.agent, header.tokens, len(data), header.nbytes)

    async def import_agent(
        self,
        src: Any,
        name: str | None = None,
        *,
        replace: bool = False,
        model: str | None = None,
        scope: str | None = None,
        max_bytes: int = MAX_IMPORT_BYTES,
        host: str | None = None,
    ) -> ClusterAgent:
        """``Session.import_agent`` on ``host`` (default: where the agent of that name is,
        else where the placement policy says): the file is read here whole, then sent to
        the host, which verifies it; ``scope``: its sharing scope there (default ``""``)."""
        if model is not None:
            raise ValueError("a cluster session serves one model: no model=")
        if scope is not None and not isinstance(scope, str):
            raise TypeError(f"scope must be a str, not {type(scope).__name__}")
        data = await read_source(src, max_bytes)
        header = await anyio.to_thread.run_sync(read_header, data)
        target = name or header.agent
        check_agent_id(target)
        if target in self._where:
            if not replace:
                raise AgentExists(f"agent {target!r} already exists (on {self._where[target]!r})")
            if host is not None and host != self._where[target]:
                raise ValueError(f"agent {target!r} is on host {self._where[target]!r}")
            host = self._where[target]
        where = host or self.placement.choose(target, await self._loads())
        hosts = self.engine_hosts
        await hosts.call(
            hosts.get(where), EngineHost.import_portable, data, target, replace, scope or ""
        )
        self._where[target] = where
        await self.replicate(target)
        return ClusterAgent(self, target)

    async def prefetch(self, name: str) -> None:
        await self.engine_hosts.call(self.host_of(name), EngineHost.prefetch, name)

    async def _hint(self, hint: Hint, prefetch: int) -> None:
        """Each part of ``hint`` goes to the host that holds its agents (agents not placed
        are left out)."""
        for host, part in split_hint(hint, self._where).items():
            await self.engine_hosts.call(
                self.engine_hosts.get(host), EngineHost.hint, part, prefetch
            )

    async def end_turns(self) -> int:
        """``Session.end_turns`` on every host still here, for a close to come: decoding
        turns end at their next step and are saved; others fail with TurnEnded. Returns
        how many turns the hosts ended."""
        return sum(await self.engine_hosts.each(EngineHost.end_turns))

    def host_of(self, agent: str) -> Host:
        """The host that serves ``agent``. Raises UnknownAgent, HostLost (gone with it)."""
        check_agent_id(agent)
        try:
            host = self.engine_hosts.any(self._where[agent])
        except KeyError:
            raise UnknownAgent(f"no agent named {agent!r} on any host") from None
        if self.engine_hosts.lost(host.name):
            raise HostLost(
                f"agent {agent!r} was on engine host {host.name!r}, which is gone, and had "
                "no replica (replicas=2 keeps one on another host)"
            )
        return host

    async def place(self, name: str, host: str) -> Migration | None:
        """Move agent ``name`` to ``host`` with its cache (None when it is there already).
        Its host saves and releases it, the new host verifies and adopts its files, then
        the old one forgets them: the last committed turn is never lost. Raises what
        verification raises (CacheRejected: the agent stays where it was)."""
        source = self.host_of(name)
        target = self.engine_hosts.get(host)
        if source is target:
            return None
        hosts = self.engine_hosts
        began = time.perf_counter()
        scope: str = await hosts.call(source, EngineHost.scope_of, name)
        files = hosts.remote(source, EngineHost.export, name)  # stays in the object store
        # The source keeps its files when this fails; it resumes the agent on its next call.
        nbytes: int = await hosts.get_ref(
            target, hosts.remote(target, EngineHost.adopt, name, files, scope)
        )
        self._where[name] = target.name
        self.prefixes.move(name, target.name)
        await hosts.call(source, EngineHost.forget, name)
        moved = Migration(
            agent=name,
            source=source.name,
            target=target.name,
            nbytes=nbytes,
            seconds=time.perf_counter() - began,
        )
        self._migrations.append(moved)
        if self._replica.get(name) == target.name:  # its replica is now its own host
            await self._drop_replica(name)
            await self.replicate(name)
        return moved

    async def rebalance(self) -> list[Migration]:
        """Move agents from the host with the most (running or warm) to the one with the
        fewest until they differ by at most one; the moves made."""
        moves: list[Migration] = []
        while True:
            infos = await self._loads()
            counts = {i.name: [a for a, h in self._where.items() if h == i.name] for i in infos}
            most = max(counts, key=lambda h: (len(counts[h]), h))
            least = min(counts, key=lambda h: (len(counts[h]), h))
            if len(counts[most]) - len(counts[least]) <= 1:
                return moves
            moved = await self.place(sorted(counts[most])[-1], least)
            if moved is not None:
                moves.append(moved)


def open_cluster(
    model: ModelSpec = None,
    *,
    cluster: str = "auto",
    cache_dir: str | os.PathLike[str],
    hosts_per_node: int = 1,
    placement: PlacementPolicy | None = None,
    ray_options: dict[str, Any] | None = None,
    replicas: int = 1,
    **options: Any,
) -> Opening[ClusterSession]:
    """A session over engine hosts on a Ray cluster (see the module doc): ``cluster`` is
    "auto" (a running cluster, else a local one on 127.0.0.1), "local", an address, or
    ``ray://host:port``; ``cache_dir`` the folder each host keeps its warm tier under (on
    its own node's disk: ``<cache_dir>/hosts/<host>``); ``ray_options`` go to ``ray.init``
    of a local cluster (``num_cpus`` ...); ``replicas=2`` keeps a copy of every agent's
    warm cache on a second host (another node where there is one), updated after each
    turn, so that a host gone for good loses no cache; ``options`` go to each host's
    ``kvactor.open`` (``budget_bytes``, ``max_batch`` ...). Raises ImportError without Ray
    (``pip install 'kvactor[ray]'``)."""
    loopback_before_import(cluster)
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ImportError("a cluster needs Ray: pip install 'kvactor[ray]'") from None
    if "cluster" in options:
        raise TypeError("cluster is given once")
    session = ClusterSession(
        model,
        cluster,
        cache_dir,
        hosts_per_node=hosts_per_node,
        placement=placement,
        ray_options=ray_options,
        options=options,
        replicas=replicas,
    )
    return Opening(session.start, session.__aexit__)
