"""A session in this process: the session API (declared once, for here and a cluster), the
session, its agents' handles, each model's part, and opening one."""

from __future__ import annotations

from ._api import TURN_KINDS as TURN_KINDS
from ._api import AgentAPI as AgentAPI
from ._api import AgentTurns as AgentTurns
from ._api import SessionAPI as SessionAPI
from ._api import TurnKind as TurnKind
from ._api import TurnStream as TurnStream
from ._carry import ExportStream as ExportStream
from ._carry import ImportSource as ImportSource
from ._carry import kvactor_version as kvactor_version
from ._carry import read_source as read_source
from ._carry import write_bytes as write_bytes
from ._carry import write_pieces as write_pieces
from ._handle import Agent as Agent
from ._handle import TextStream as TextStream
from ._model_part import model_folder as model_folder
from ._opening import MODELS_KEYS as MODELS_KEYS
from ._opening import Opening as Opening
from ._opening import OpenOptions as OpenOptions
from ._opening import open_session as open_session
from ._session import Session as Session

__all__ = (
    "Agent",
    "ExportStream",
    "ImportSource",
    "kvactor_version",
    "read_source",
    "write_bytes",
    "write_pieces",
    "AgentAPI",
    "AgentTurns",
    "MODELS_KEYS",
    "OpenOptions",
    "Opening",
    "Session",
    "SessionAPI",
    "TURN_KINDS",
    "TextStream",
    "TurnKind",
    "TurnStream",
    "model_folder",
    "open_session",
)
