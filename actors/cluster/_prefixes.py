"""What each host of a cluster holds, as block hashes of token prefixes, so that a new agent
goes where its prompt's prefix already is.

A prompt's tokens are cut into blocks of :data:`BLOCK` tokens; block k's hash covers the
hash of block k-1 and its own tokens (BLAKE2b, 8 bytes), so one hash names a whole prefix
and two prompts that share the first k blocks share the first k hashes. Hosts compute an
agent's hashes after each of its turns (:meth:`EngineHost.turn` sends them with the turn's
Completion) and of the warm caches on their disks at start: the front learns what a host
holds as it changes, never by asking each host per request. The last part-block of a
prompt is not hashed: a prefix is counted in whole blocks.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from collections.abc import Sequence

__all__ = ("BLOCK", "HeldPrefixes", "prefix_blocks")

#: Tokens per hashed block (a 4K-token prompt: 64 hashes, 512 bytes).
BLOCK = 64


def prefix_blocks(tokens: Sequence[int], block: int = BLOCK) -> list[int]:
    """The chained hashes of ``tokens``' whole blocks: entry k names tokens[: (k+1)*block]."""
    out: list[int] = []
    previous = b""
    for start in range(0, len(tokens) - block + 1, block):
        h = hashlib.blake2b(previous, digest_size=8)
        h.update(array("I", tokens[start : start + block]).tobytes())
        previous = h.digest()
        out.append(int.from_bytes(previous, "little"))
    return out


class HeldPrefixes:
    """The front's index of what each host holds: host -> agent -> the agent's block
    hashes, and per host how many of its agents hold each hash. Owned by the
    ClusterSession, the only writer."""

    def __init__(self, block: int = BLOCK) -> None:
        self.block = block
        self._of: dict[str, tuple[str, list[int]]] = {}  # agent -> (host, blocks)
        self._count: dict[str, Counter[int]] = {}  # host -> block hash -> agents holding it
        self._heads: dict[str, Counter[int]] = {}  # host -> first block's hash -> agents

    def update(self, host: str, agent: str, blocks: Sequence[int]) -> None:
        """``agent`` (on ``host``) holds the prefix ``blocks`` name now."""
        self.drop(agent)
        self._of[agent] = (host, list(blocks))
        self._count.setdefault(host, Counter()).update(blocks)
        if blocks:
            self._heads.setdefault(host, Counter())[blocks[0]] += 1

    def drop(self, agent: str) -> None:
        """``agent`` holds nothing any more (forgotten, or its host is gone)."""
        held = self._of.pop(agent, None)
        if held is None:
            return
        host, blocks = held
        count = self._count[host]
        count.subtract(blocks)
        for b in set(blocks):
            if count[b] <= 0:
                del count[b]
        if blocks:
            heads = self._heads[host]
            heads[blocks[0]] -= 1
            if heads[blocks[0]] <= 0:
                del heads[blocks[0]]

    def went_cold(self, host: str, agents: Sequence[str]) -> None:
        """``agents`` of ``host`` hold nothing there any more (made cold): those the index
        has on ``host`` are dropped (one moved to another host since is kept)."""
        for agent in agents:
            held = self._of.get(agent)
            if held is not None and held[0] == host:
                self.drop(agent)

    def move(self, agent: str, host: str) -> None:
        """``agent``'s cache went to ``host`` (a migration, a replica promoted)."""
        held = self._of.get(agent)
        if held is not None:
            self.update(host, agent, held[1])

    def blocks_of(self, agent: str) -> list[int]:
        """The block hashes ``agent`` holds (none when unknown)."""
        held = self._of.get(agent)
        return list(held[1]) if held is not None else []

    def overlap(self, host: str, blocks: Sequence[int]) -> int:
        """How many leading tokens of the prompt ``blocks`` name ``host`` holds (whole
        blocks: a chained hash held means the whole prefix before it is)."""
        count = self._count.get(host)
        if not count:
            return 0
        for k in range(len(blocks), 0, -1):
            if blocks[k - 1] in count:
                return k * self.block
        return 0

    def prompts(self, host: str) -> int:
        """How many distinct prompts (first blocks) ``host``'s agents start with."""
        return len(self._heads.get(host, ()))

    def hashes(self, host: str) -> int:
        """How many distinct block hashes ``host`` holds (its summary's size)."""
        return len(self._count.get(host, ()))
