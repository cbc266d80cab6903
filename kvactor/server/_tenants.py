"""API keys and tenants: who a request comes from, and which agents it may see.

Each key belongs to a tenant. A tenant's agents live in a namespace of the session's agent
ids, ``<label>.<id>``, and share cached prefixes only among themselves (the tenant's
label is their sharing scope, ``Session.spawn_agent(scope=...)``). The label is the key's
name when it has one (several keys may share a name: rotate keys without losing agents),
else ``k`` and 16 hex digits of a sha256 of the key: stable across restarts, never the key.
An admin key sees every agent under its full id; without keys the server has one open
tenant that sees everything, as an admin does.

A key entry, as ``--api-key``, a line of ``--api-key-file`` and ``KVACTOR_API_KEYS`` take
it: ``KEY`` or ``NAME:KEY`` (the name: letters, digits, ``_``, ``-``, at most 32; a key
holding a ``:`` needs a name first), optionally followed by the word ``admin``. A key has
at least 8 characters and no white space.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ..actors.ids import AGENT_ID_MAX, check_agent_id
from ._errors import ApiError

__all__ = ("OPEN", "Keys", "Tenant", "key_entries")

MIN_KEY_CHARS = 8
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,31}")
ENV_VAR = "KVACTOR_API_KEYS"


@dataclass(frozen=True)
class Tenant:
    """Who a request comes from: its ``label`` (its namespace and sharing scope; "" for
    an admin or the open server, whose namespace is every agent) and whether it is an
    ``admin`` (sees every agent, reads ``/metrics``)."""

    label: str
    admin: bool = False

    @property
    def prefix(self) -> str:
        """What the session's id of each of its agents starts with ("" for all agents)."""
        return f"{self.label}." if self.label else ""

    def full_id(self, agent: str) -> str:
        """The session's id of this tenant's agent ``agent``. Raises InvalidAgentId (a
        400) for a hostile id or one too long once prefixed."""
        check_agent_id(agent)
        full = self.prefix + agent
        if len(full) > AGENT_ID_MAX:
            room = AGENT_ID_MAX - len(self.prefix)
            raise ApiError(400, f"agent ids have at most {room} characters", param="agent_id")
        return full

    def owns(self, full: str) -> bool:
        """Whether the session's agent ``full`` is this tenant's to see."""
        return full.startswith(self.prefix)

    def local_id(self, full: str) -> str:
        """The id this tenant knows its agent ``full`` by."""
        return full[len(self.prefix) :]


OPEN = Tenant("", admin=True)  # the server without keys: one tenant, every agent


def _label_of(key: str) -> str:
    digest = hashlib.sha256(b"kvactor tenant\0" + key.encode()).hexdigest()
    return "k" + digest[:16]


def _entry(text: str) -> tuple[str, Tenant]:
    """A key entry (see the module doc) as its key and tenant. Raises ValueError."""
    words = text.split()
    admin = len(words) == 2 and words[1] == "admin"
    if not words or len(words) > 2 or (len(words) == 2 and not admin):
        raise ValueError("a key entry is KEY or NAME:KEY, then optionally 'admin'")
    name, sep, key = words[0].partition(":")
    if not sep:
        name, key = "", words[0]
    elif not _NAME.fullmatch(name):
        raise ValueError(
            f"key name {name[:40]!r}: letters, digits, '_' and '-' only, at most 32 "
            "(a key holding ':' needs a name first)"
        )
    if len(key) < MIN_KEY_CHARS:
        raise ValueError(f"API keys have at least {MIN_KEY_CHARS} characters")
    return key, Tenant("" if admin else name or _label_of(key), admin=admin)


def key_entries(
    keys: Iterable[str] = (), files: Iterable[str | os.PathLike[str]] = (), *, env: bool = True
) -> list[str]:
    """Key entries from ``keys``, each of ``files`` (one a line; blank lines and lines
    starting with ``#`` left out) and, with ``env``, ``$KVACTOR_API_KEYS`` (entries
    separated by commas or new lines). Raises OSError for a file that cannot be read."""
    out = list(keys)
    for path in files:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
        out += [line.strip() for line in lines if line.strip() and line.lstrip()[:1] != "#"]
    if env:
        raw = os.environ.get(ENV_VAR, "")
        out += [part.strip() for part in re.split(r"[,\n]", raw) if part.strip()]
    return out


class Keys:
    """The keys a server takes, each with its tenant; none: an open server.

    Raises ValueError for a malformed entry (``admin`` entries are admin keys whatever
    they say)."""

    def __init__(self, entries: Iterable[str] = (), admin: Iterable[str] = ()) -> None:
        pairs = [_entry(e) for e in entries]
        pairs += [(_entry(e)[0], Tenant("", admin=True)) for e in admin]
        # Digests, so that every comparison takes the same time whatever the lengths.
        self._keys = [(hashlib.sha256(k.encode()).digest(), t) for k, t in pairs]
        self._labels = frozenset(t.label for _, t in pairs if t.label)

    def __bool__(self) -> bool:
        return bool(self._keys)

    @property
    def tenants(self) -> int:
        """How many tenants the keys make (admins not counted)."""
        return len(self._labels)

    def tenant(self, headers: Mapping[str, str]) -> Tenant | None:
        """The tenant whose key the request presents (``Authorization: Bearer KEY`` or
        ``x-api-key: KEY``); None when it presents none that is valid. Every key is
        compared, in constant time, whichever matches."""
        if not self._keys:
            return OPEN
        presented = _presented(headers)
        if presented is None:
            return None
        digest = hashlib.sha256(presented.encode()).digest()
        found = None
        for key, tenant in self._keys:
            if hmac.compare_digest(key, digest):
                found = tenant
        return found

    def scope_of(self, full: str) -> str:
        """The sharing scope of the session's agent ``full``: its tenant's label when its
        id is in a tenant's namespace (also when an admin made it), else ""."""
        label = full.partition(".")[0]
        return label if "." in full and label in self._labels else ""


def _presented(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization")
    if auth is not None:
        scheme, _, value = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    key = headers.get("x-api-key")
    return key.strip() if key and key.strip() else None
