"""A local Ray cluster listens on 127.0.0.1 only: every listening TCP socket of its processes
(the driver, GCS, raylet, agents, the engine hosts' workers), read from ``/proc``."""

from __future__ import annotations

import functools
import ipaddress
import os
import sys
from pathlib import Path

import pytest

import kvactor
from kvactor.actors.models import make_tiny_model

tiny = functools.partial(make_tiny_model, 0, head_dim=64)

pytestmark = [
    pytest.mark.ray,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # a cluster session runs on asyncio, as Ray's async actors do


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:  # gone meanwhile
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def _address(hexed: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net/tcp{,6} spell it (32-bit words in host byte order)."""
    words = [bytes.fromhex(hexed[i : i + 8]) for i in range(0, len(hexed), 8)]
    raw = b"".join(w[::-1] if sys.byteorder == "little" else w for w in words)
    return ipaddress.ip_address(raw)


def _listening() -> dict[str, str]:
    """Listening TCP sockets by inode: their local address."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                host, port = fields[1].split(":")
                found[fields[9]] = f"{_address(host)} port {int(port, 16)}"
    return found


def _sockets_of(pid: int) -> list[str]:
    inodes = []
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.append(target[len("socket:[") : -1])
    except OSError:  # gone meanwhile
        pass
    return inodes


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.split()[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


async def test_every_listening_socket_of_a_local_cluster_is_on_loopback(tmp_path: Path) -> None:
    options = {"num_cpus": 2}
    async with kvactor.open(tiny, cluster="local", cache_dir=tmp_path, ray_options=options) as kv:
        agent = await kv.spawn_agent("a")
        await agent.generate("hello", max_tokens=2)  # the engine host's worker is up
        listening = _listening()
        seen: dict[int, list[str]] = {}
        for pid in _descendants(os.getpid()):
            addresses = [listening[i] for i in _sockets_of(pid) if i in listening]
            if addresses:
                seen[pid] = addresses
        commands = {pid: Path(f"/proc/{pid}/cmdline").read_bytes()[:200] for pid in seen}
    everything = [(pid, a) for pid, addresses in seen.items() for a in addresses]
    # The GCS, the raylet, the driver and the workers all listen: a check that saw none
    # would prove nothing.
    assert len(seen) >= 4, seen
    assert any(b"gcs_server" in c for c in commands.values()), commands
    assert any(b"raylet" in c for c in commands.values()), commands
    outside = [(pid, a, commands[pid]) for pid, a in everything if not _loopback(a)]
    assert outside == []
