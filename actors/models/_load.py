"""Model loading: the default GGUF model, any llama GGUF, MLX / Hugging Face directories,
and a tiny random model for tests. Nothing here downloads from a model hub.

Everything that creates MLX arrays must run on the engine's MLX thread. Fetching the default
model (``default_model_path`` / ``fetch_default_model``, from ``_fetch``) is plain file and
subprocess work and may run anywhere; do it ahead of time to keep the engine thread free.

Weights on CPU are dequantized to fp32 because that is the only dtype MLX's CPU backend hands
to BLAS. Measured here (2 cores, OpenBLAS), x @ W.T with W 1536x576:
  1 token:    fp32 0.27 ms, Q4 quantized_matmul 0.93 ms (fp32 scales) / 45 ms (fp16), bf16 1.2 ms
  512 tokens: fp32 7.2 ms,  Q4 quantized_matmul 470 ms,                              bf16 235 ms
On Metal / CUDA the quantized kernels are fast and weights stay quantized.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import make_prompt_cache

from ...kernels.geometry import CacheGeometry
from ...kernels.qcodec import KVCodec
from ..errors import ModelLoadError
from ..records import ModelInfo
from . import _gguf
from ._bpe import tiny_byte_tokenizer
from ._fetch import DEFAULT_MODEL_NAME as DEFAULT_MODEL_NAME
from ._fetch import default_model_path as default_model_path
from ._fetch import fetch_default_model as fetch_default_model
from ._fetch import file_digest
from ._fetch import model_dir as model_dir
from ._probe import probe_geometry as probe_geometry
from ._tiny import ONE_PLUS_NORMS
from ._tiny import TINY_FAMILIES as TINY_FAMILIES
from ._tokenizer import MlxLmTokenizer, Tokenizer

__all__ = (
    "DEFAULT_MODEL_NAME",
    "LoadedModel",
    "default_model_path",
    "fetch_default_model",
    "load_model",
    "make_tiny_model",
    "model_dir",
    "probe_geometry",
    "tiny_model",
)

_DEFAULT_SPECS = ("default", "smollm2", DEFAULT_MODEL_NAME.lower())
_WEIGHT_MODES = ("auto", "fp32", "quantized")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.json",
    "chat_template.jinja",
    "generation_config.json",
)


@dataclass(frozen=True, eq=False)
class LoadedModel:
    """A model ready for the engine: ``model(tokens[None], cache=cache)`` returns logits.

    ``fingerprint`` (sha256 hex over architecture, weights and tokenizer) decides whether a
    saved KV cache belongs to this model. ``weights`` is ``"fp32"`` (all dequantized) or
    ``"quantized"`` (packed as in the file); the fingerprint does not depend on it, as both
    compute with the same weight values.
    """

    model: nn.Module
    tokenizer: Tokenizer
    name: str
    context_length: int
    fingerprint: str
    weights: str
    geometry: CacheGeometry  # every layer's KV cache, read from the model (probe_geometry)
    path: Path | None = None

    @property
    def n_layers(self) -> int:
        return self.geometry.n_layers

    @property
    def n_kv_heads(self) -> int:
        """KV heads of the first K/V layer (every layer's: ``geometry``; 0: none)."""
        kv = self.geometry.kv_layers
        return self.geometry.layer(kv[0]).n_kv_heads if kv else 0

    @property
    def head_dim(self) -> int:
        """Key width of the first K/V layer (every layer's, and value widths: ``geometry``;
        0: none)."""
        kv = self.geometry.kv_layers
        return self.geometry.layer(kv[0]).key_dim if kv else 0

    def info(self, codec: KVCodec) -> ModelInfo:
        """What agents and the warm tier know of this model, its caches stored with
        ``codec``."""
        return ModelInfo(
            name=self.name,
            fingerprint=self.fingerprint,
            context_length=self.context_length,
            n_layers=self.n_layers,
            n_kv_heads=self.n_kv_heads,
            head_dim=self.head_dim,
            codec=codec.describe(),
            vocab_size=self.tokenizer.vocab_size,
            geometry=self.geometry.describe(),
            states=self.geometry.describe_states(),
        )

    def make_cache(self) -> list[Any]:
        """A fresh mlx-lm prompt cache (one entry per layer)."""
        return make_prompt_cache(self.model)


# ---------------------------------------------------------------- loading


def load_model(spec: str | os.PathLike[str] | None = None, *, weights: str = "auto") -> LoadedModel:
    """Load a model: ``None`` / ``"default"`` / ``"smollm2"`` (the default model, fetched if
    needed), a ``.gguf`` file (llama architecture), or an MLX / Hugging Face model directory.

    ``weights``: ``"fp32"`` dequantizes everything to float32 (fast on CPU with a good BLAS),
    ``"quantized"`` keeps the file's quantized weights packed (on the CPU device their
    scales and other float tensors become fp32), ``"auto"`` picks fp32 on the CPU
    device and quantized on a GPU. Must run on the thread that owns MLX.

    Raises ValueError for an unknown ``weights``; ModelLoadError for a missing file, a file
    that is not a GGUF, an unsupported architecture or tokenizer, a corrupt file, or a
    failed verification of the default model.
    """
    if weights not in _WEIGHT_MODES:
        raise ValueError(f"weights must be one of {_WEIGHT_MODES}, not {weights!r}")
    on_cpu = mx.default_device().type == mx.cpu
    fp32 = weights == "fp32" or (weights == "auto" and on_cpu)
    if spec is None or (isinstance(spec, str) and spec.lower() in _DEFAULT_SPECS):
        loaded = _load_gguf(default_model_path(), fp32, on_cpu)
        return _renamed(loaded, DEFAULT_MODEL_NAME)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model not found: {path}")
    if path.is_dir():
        return _load_directory(path.resolve(), fp32, on_cpu)
    return _load_gguf(path.resolve(), fp32, on_cpu)


def _renamed(loaded: LoadedModel, name: str) -> LoadedModel:
    return LoadedModel(**{**loaded.__dict__, "name": name})


def _load_gguf(path: Path, fp32: bool, on_cpu: bool) -> LoadedModel:
    try:
        tensors, metadata = _gguf.read_gguf(path)
        args = _gguf.llama_args(metadata, tensors)
        tokenizer = _gguf.tokenizer_from_metadata(metadata)
        model = _gguf.build_llama(args, tensors)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    del tensors  # lets the packed arrays go once fp32 conversion replaces their layers
    _settle_dtypes(model, fp32, on_cpu)
    if tokenizer.vocab_size > args.vocab_size:
        raise ModelLoadError(f"{path}: tokenizer has more tokens than the embedding has rows")
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=path.stem,
        context_length=int(args.max_position_embeddings or 2048),
        fingerprint=_fingerprint(_arch_of(args), file_digest(path), tokenizer.digest),
        weights="fp32" if fp32 else "quantized",
        geometry=probe_geometry(model, "llama"),
        path=path,
    )


def _load_directory(path: Path, fp32: bool, on_cpu: bool) -> LoadedModel:
    # Import lazily: mlx_lm.utils pulls in transformers, which is slow to import.
    from mlx_lm.utils import load as mlx_lm_load

    safetensors = sorted(path.glob("*.safetensors"))
    if not (path / "config.json").is_file() or not safetensors:
        raise ModelLoadError(f"{path} is not an MLX / Hugging Face model directory")
    try:
        # An existing local path never reaches the hub in mlx_lm.load.
        loaded: Any = mlx_lm_load(str(path), return_config=True)
        model, wrapper, config = loaded
    except (ValueError, FileNotFoundError, OSError, KeyError) as exc:
        raise ModelLoadError(f"cannot load {path} with mlx-lm: {exc}") from exc
    _settle_dtypes(model, fp32, on_cpu)

    weights_digest = hashlib.sha256()
    for file in safetensors:
        weights_digest.update(f"{file.name}:{file_digest(file)}\n".encode())
    tok_digest = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        if (path / name).is_file():
            tok_digest.update(f"{name}:{file_digest(path / name)}\n".encode())
    tokenizer = MlxLmTokenizer(wrapper, tok_digest.hexdigest())

    args = getattr(model, "args", None)
    family = str(_setting(config, args, "model_type", "unknown"))
    try:
        geometry = probe_geometry(model, family)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from None
    context = _setting(config, args, "max_position_embeddings", None) or 4096
    arch = {"config": config}
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=path.name,
        context_length=int(context),
        fingerprint=_fingerprint(arch, weights_digest.hexdigest(), tokenizer.digest),
        weights="fp32" if fp32 else "quantized",
        geometry=geometry,
        path=path,
    )


def _setting(config: dict[str, Any], args: Any, key: str, default: Any) -> Any:
    value = config.get(key)
    if value is None:
        value = config.get("text_config", {}).get(key)
    if value is None and args is not None:
        value = getattr(args, key, None)
    return default if value is None else value


def _settle_dtypes(model: nn.Module, fp32: bool, on_cpu: bool) -> None:
    if fp32:
        _to_fp32(model)
    elif on_cpu:
        # Quantized on CPU: fp16 scales make every activation fp16, and MLX's CPU fp16
        # kernels are ~50x slower than fp32 ones; the packed weights stay as they are.
        model.set_dtype(mx.float32)
    mx.eval(model.parameters())


def _to_fp32(model: nn.Module) -> None:
    """Dequantize quantized layers in place and cast every float parameter to float32."""
    replacements: list[tuple[str, nn.Module]] = []
    for path, module in model.named_modules():
        if isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding):
            weight = _dequantized(module)
            if isinstance(module, nn.QuantizedEmbedding):
                plain: nn.Module = nn.Embedding(*weight.shape)
            else:
                has_bias = "bias" in module
                plain = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias)
                if has_bias:
                    plain.bias = module.bias.astype(mx.float32)
            plain.weight = weight
            replacements.append((path, plain))
    if replacements:
        model.update_modules(tree_unflatten(replacements))
    model.set_dtype(mx.float32)


def _dequantized(module: nn.Module) -> mx.array:
    # Dequantize in fp32: fp16 arithmetic would round every weight a second time.
    biases = module.get("biases")
    return mx.dequantize(
        module.weight,
        module.scales.astype(mx.float32),
        None if biases is None else biases.astype(mx.float32),
        group_size=module.group_size,
        bits=module.bits,
        mode=getattr(module, "mode", "affine"),
        dtype=mx.float32,
    )


def _arch_of(args: Any) -> dict[str, Any]:
    return {k: v for k, v in sorted(vars(args).items()) if not k.startswith("_")}


def _fingerprint(arch: dict[str, Any], weights_digest: str, tokenizer_digest: str) -> str:
    blob = json.dumps(
        {"arch": arch, "weights": weights_digest, "tokenizer": tokenizer_digest},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


# ---------------------------------------------------------------- the tiny test models


def make_tiny_model(seed: int = 0, family: str = "llama", **overrides: Any) -> LoadedModel:
    """A tiny random model of an mlx-lm ``family`` (a key of :data:`TINY_FAMILIES`; the
    llama: 2 layers, hidden 64, 4 heads / 2 KV heads, head_dim 16) over a byte-level
    tokenizer with ChatML specials; fp32, deterministic given ``seed``.

    ``overrides`` replace fields of the family's mlx-lm ``ModelArgs`` (of its
    ``text_config`` for a family that has one) (``num_hidden_layers=4`` ...). Raises
    TypeError for an unknown field, ValueError for an unknown family.
    """
    if family not in TINY_FAMILIES:
        raise ValueError(f"family must be one of {sorted(TINY_FAMILIES)}, not {family!r}")
    config = dict(TINY_FAMILIES[family])
    if "text_config" in config:
        config["text_config"] = {**config["text_config"], **overrides}
    else:
        config.update(overrides)
    return tiny_model(family, config, seed)


def tiny_model(family: str, config: dict[str, Any], seed: int = 0) -> LoadedModel:
    """A tiny random model of the mlx-lm model type ``family`` with the fields ``config``
    of its ``ModelArgs`` (``text_config``: of its text model), the tiny byte tokenizer's
    vocabulary and a context of 2048 (where the arguments take them); fp32, deterministic
    given ``seed``. Raises ImportError for an unknown model type, TypeError for an unknown
    field, ValueError (or what mlx-lm raises) for a configuration mlx-lm refuses, and
    ValueError naming the layer for caches kvactor cannot store (``probe_geometry``)."""
    module = importlib.import_module(f"mlx_lm.models.{family}")
    tokenizer = tiny_byte_tokenizer()
    fields = _tiny_fields(module.ModelArgs, family, config, tokenizer.vocab_size)
    args = module.ModelArgs(**fields)
    model = module.Model(args)
    # numpy's generator is specified bit-for-bit across platforms, unlike default init.
    rng = np.random.default_rng(seed)
    params: list[tuple[str, mx.array]] = []
    weights_digest = hashlib.sha256()
    shapes: Any = tree_flatten(model.parameters())
    for name, value in sorted(shapes, key=lambda kv: kv[0]):
        array: np.ndarray[Any, np.dtype[np.float32]]
        if name.endswith("norm.weight"):
            # Gemma's norms scale by 1 + weight: zeros there are ones elsewhere.
            fill = 0.0 if family in ONE_PLUS_NORMS else 1.0
            array = np.full(value.shape, fill, dtype=np.float32)
        else:
            array = rng.normal(0.0, 0.05, size=value.shape).astype(np.float32)
        weights_digest.update(name.encode() + array.tobytes())
        params.append((name, mx.array(array)))
    model.load_weights(params, strict=True)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    prefix = "tiny-llama" if family == "llama" else f"tiny-{family}"
    context = getattr(args, "max_position_embeddings", None)
    text = getattr(args, "text_config", None)
    if context is None and isinstance(text, dict):
        context = text.get("max_position_embeddings")
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=f"{prefix}-seed{seed}",
        context_length=int(context or 2048),
        fingerprint=_fingerprint(_arch_of(args), weights_digest.hexdigest(), tokenizer.digest),
        weights="fp32",
        geometry=probe_geometry(model, family),
    )


def _tiny_fields(
    model_args: type, family: str, config: dict[str, Any], vocab: int
) -> dict[str, Any]:
    """``config`` with the model type, vocabulary and context filled in where the
    arguments (or their ``text_config``) have such fields."""
    names = {f.name for f in dataclasses.fields(model_args)}
    sizes = {"vocab_size": vocab, "vocab_size_per_layer_input": vocab}
    if "text_config" in names:
        text = {"model_type": family, **sizes, "max_position_embeddings": 2048}
        return {
            "model_type": family,
            **config,
            "text_config": {**text, **config.get("text_config", {})},
        }
    fields: dict[str, Any] = {"model_type": family}
    for key, value in (*sizes.items(), ("max_position_embeddings", 2048)):
        if key in names:
            fields[key] = value
    return {**fields, **config}
