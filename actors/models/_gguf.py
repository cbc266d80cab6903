"""GGUF (llama architecture) -> mlx-lm llama model and tokenizer.

``mx.load(path, return_metadata=True)`` does the file parsing. It returns Q4_0/Q4_1/Q8_0
tensors as MLX affine triples ``name.weight`` (packed uint32) / ``name.scales`` /
``name.biases`` (float16, GGUF block = group of 32), F32/F16/BF16 tensors as plain arrays, and
scalar metadata as 0-d arrays. Every function here raises ValueError for a file it cannot
turn into a model; the caller wraps that into ``ModelLoadError``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import llama

from ._bpe import ByteLevelBPETokenizer

__all__ = (
    "GGUF_MAGIC",
    "build_llama",
    "check_magic",
    "llama_args",
    "read_gguf",
    "tokenizer_from_metadata",
)

GGUF_MAGIC = b"GGUF"
_GGUF_GROUP = 32  # block size of the GGUF types MLX reads quantized (Q4_0, Q4_1, Q8_0)

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias|scales|biases)")
_TOP = re.compile(r"(\w+)\.(weight|bias|scales|biases)")


def check_magic(path: Path) -> None:
    """Raises ValueError unless ``path`` starts with the GGUF magic; OSError if unreadable."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file (magic {head!r}, expected {GGUF_MAGIC!r})")


def read_gguf(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Weights and metadata of a GGUF file.

    Raises ValueError for a truncated/corrupt file or tensor types MLX cannot read.
    """
    check_magic(path)
    try:
        loaded: Any = mx.load(str(path), return_metadata=True)
        weights, metadata = loaded
    except (RuntimeError, ValueError) as exc:
        hint = ""
        if "not supported" in str(exc):
            hint = " (MLX reads GGUF tensors of type F32, F16, BF16, Q4_0, Q4_1 and Q8_0 only)"
        raise ValueError(f"cannot read {path}: {exc}{hint}") from exc
    if not isinstance(weights, dict):
        raise ValueError(f"cannot read {path}: no tensors")
    return weights, dict(metadata)


def scalar(metadata: dict[str, Any], key: str, default: Any = None) -> Any:
    value = metadata.get(key, default)
    if isinstance(value, mx.array):
        return value.item()
    return value


def _required(metadata: dict[str, Any], key: str) -> Any:
    value = scalar(metadata, key)
    if value is None:
        raise ValueError(f"GGUF metadata lacks {key!r}")
    return value


def llama_args(metadata: dict[str, Any], weights: dict[str, mx.array]) -> llama.ModelArgs:
    """mlx-lm ``ModelArgs`` from ``llama.*`` metadata.

    Uses ``rope_traditional=True``: llama.cpp's converter permutes each head's q/k rows from
    Hugging Face's half-split rotary layout to interleaved pairs, which is exactly what
    traditional RoPE rotates. Scores q.k are unchanged, so no un-permuting is needed (the K
    cache just holds each head's dimensions in GGUF order).

    Raises ValueError for another architecture or a llama variant we do not handle.
    """
    arch = scalar(metadata, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r} (only 'llama' is supported)")
    if "rope_freqs.weight" in weights:
        raise ValueError("unsupported: per-frequency RoPE scaling (rope_freqs, Llama 3.1 style)")
    if "token_embd.weight" not in weights:
        raise ValueError("GGUF has no token_embd.weight")

    hidden = int(_required(metadata, "llama.embedding_length"))
    heads = int(_required(metadata, "llama.attention.head_count"))
    kv_heads = int(scalar(metadata, "llama.attention.head_count_kv", heads))
    head_dim = int(scalar(metadata, "llama.attention.key_length", hidden // heads))
    rope_dims = int(scalar(metadata, "llama.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ValueError(f"unsupported: partial rotary ({rope_dims} of {head_dim} dims)")
    if int(scalar(metadata, "llama.expert_count", 0) or 0) > 0:
        raise ValueError("unsupported: mixture-of-experts llama GGUF")

    rope_scaling: dict[str, float | str] | None = None
    scaling = scalar(metadata, "llama.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ValueError(f"unsupported RoPE scaling {scaling!r}")
        factor = float(_required(metadata, "llama.rope.scaling.factor"))
        rope_scaling = {"type": "linear", "factor": factor}

    return llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=int(_required(metadata, "llama.block_count")),
        intermediate_size=int(_required(metadata, "llama.feed_forward_length")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(scalar(metadata, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        # The embedding's row count is authoritative; llama.vocab_size is often absent.
        vocab_size=int(weights["token_embd.weight"].shape[0]),
        max_position_embeddings=int(scalar(metadata, "llama.context_length", 2048)),
        rope_theta=float(scalar(metadata, "llama.rope.freq_base", 10000.0)),
        rope_traditional=True,
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in weights,
        attention_bias="blk.0.attn_q.bias" in weights,
    )


def _mlx_name(name: str) -> str:
    if match := _BLOCK.fullmatch(name):
        layer, part, kind = match.groups()
        if part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    elif (match := _TOP.fullmatch(name)) and match.group(1) in _TOP_NAMES:
        return f"{_TOP_NAMES[match.group(1)]}.{match.group(2)}"
    raise ValueError(f"unexpected GGUF tensor {name!r}")


def build_llama(args: llama.ModelArgs, weights: dict[str, mx.array]) -> llama.Model:
    """The mlx-lm llama model holding ``weights`` as stored: quantized layers stay quantized
    (``QuantizedLinear`` / ``QuantizedEmbedding``), float tensors keep their dtype.

    Raises ValueError for unknown tensor names or shapes that do not fit ``args``.
    """
    mapped = {_mlx_name(k): v for k, v in weights.items()}
    quantized: dict[str, dict[str, int]] = {}
    for name, scales in mapped.items():
        if not name.endswith(".scales"):
            continue
        module = name.removesuffix(".scales")
        packed = mapped.get(f"{module}.weight")
        if packed is None:
            raise ValueError(f"{module} has scales but no weight")
        in_features = scales.shape[-1] * _GGUF_GROUP
        bits, rem = divmod(packed.shape[-1] * 32, in_features)
        if rem or bits not in (2, 3, 4, 5, 6, 8):
            raise ValueError(f"cannot infer the quantization of {module} ({packed.shape})")
        quantized[module] = {"group_size": _GGUF_GROUP, "bits": bits}

    model = llama.Model(args)
    nn.quantize(model, class_predicate=lambda path, _m: quantized.get(path, False))
    try:
        model.load_weights(list(mapped.items()), strict=True)
    except ValueError as exc:
        raise ValueError(f"GGUF tensors do not fit a llama model: {exc}") from exc
    return model


def tokenizer_from_metadata(metadata: dict[str, Any]) -> ByteLevelBPETokenizer:
    """The tokenizer stored in GGUF metadata.

    Raises ValueError for a tokenizer model other than byte-level BPE (``gpt2``), an unknown
    pre-tokenizer, or inconsistent vocabulary data.
    """
    kind = scalar(metadata, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"unsupported GGUF tokenizer {kind!r}: only byte-level BPE ('gpt2') is supported; "
            "load a Hugging Face / MLX model directory instead"
        )
    tokens = metadata.get("tokenizer.ggml.tokens")
    merges = metadata.get("tokenizer.ggml.merges")
    if not isinstance(tokens, list) or not isinstance(merges, list):
        raise ValueError("GGUF metadata lacks tokenizer.ggml.tokens / tokenizer.ggml.merges")
    types = metadata.get("tokenizer.ggml.token_type")
    token_types = np.array(types).astype(int).tolist() if isinstance(types, mx.array) else None

    eos: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = scalar(metadata, f"tokenizer.ggml.{key}")
        if value is not None:
            eos.append(int(value))
    bos = scalar(metadata, "tokenizer.ggml.bos_token_id")
    template = metadata.get("tokenizer.chat_template")
    return ByteLevelBPETokenizer(
        tokens,
        merges,
        token_types=token_types,
        pre=str(scalar(metadata, "tokenizer.ggml.pre", "default")),
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos,
        add_bos=bool(scalar(metadata, "tokenizer.ggml.add_bos_token", False)),
        add_eos=bool(scalar(metadata, "tokenizer.ggml.add_eos_token", False)),
        chat_template=template if isinstance(template, str) else None,
    )
