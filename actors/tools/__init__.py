"""Tools and structured output: tool requests checked once, the families' tool-call formats
(rendering and parsing), and the grammars that constrain sampling (llguidance)."""

from __future__ import annotations

from ._formats import ToolFormat as ToolFormat
from ._formats import detect_format as detect_format
from ._formats import render_with_tools as render_with_tools
from ._grammar import JSON_FORMAT as JSON_FORMAT
from ._grammar import GrammarCompiler as GrammarCompiler
from ._grammar import RowGrammar as RowGrammar
from ._grammar import closed_objects as closed_objects
from ._grammar import mask_words as mask_words
from ._parse import ToolStream as ToolStream
from ._request import TOOL_OPTIONS as TOOL_OPTIONS
from ._request import tool_options as tool_options
from ._request import tool_request as tool_request

__all__ = (
    "GrammarCompiler",
    "JSON_FORMAT",
    "RowGrammar",
    "TOOL_OPTIONS",
    "ToolFormat",
    "ToolStream",
    "closed_objects",
    "detect_format",
    "mask_words",
    "render_with_tools",
    "tool_options",
    "tool_request",
)
