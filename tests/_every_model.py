"""Tiny configurations of every mlx-lm model type that can be built from common fields
(``tests/test_every_model.py``): each ``ModelArgs`` field named in :data:`COMMON` takes
its value (those in :data:`REQUIRED_ONLY` only where the field has no default), the rest
keep their defaults; a type with another required field is skipped, with its reason."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import Any

import mlx_lm.models
from mlx.utils import tree_flatten

from kvactor.actors.models._load import _tiny_fields
from kvactor.actors.models._tiny import TINY_FAMILIES

#: A tiny model's parameters at most.
MAX_PARAMETERS = 2_000_000

#: Values of common ``ModelArgs`` fields for a tiny model (2 layers, hidden 64, heads 64
#: wide: the default codec stores them).
COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_layers": 2,
    "n_layer": 2,
    "n_layers": 2,
    "intermediate_size": 128,
    "ffn_hidden_size": 128,
    "n_inner": 128,
    "num_attention_heads": 2,
    "num_heads": 2,
    "n_head": 2,
    "n_heads": 2,
    "num_key_value_heads": 1,
    "num_kv_heads": 1,
    "n_kv_heads": 1,
    "head_dim": 64,
    "n_embd": 128,
    "d_model": 128,
    "n_ctx": 2048,
    "n_positions": 2048,
    "block_size": 2048,
    "rms_norm_eps": 1e-5,
    "layer_norm_eps": 1e-5,
    "layer_norm_epsilon": 1e-5,
    "norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rotary_emb_base": 10000.0,
    "rotary_pct": 1.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
    "use_bias": False,
    "use_qkv_bias": False,
    "sliding_window": 16,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "first_k_dense_replace": 1,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "n_group": 1,
    "topk_group": 1,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
}

#: Values given only where the field has no default.
REQUIRED_ONLY: dict[str, Any] = {
    "q_lora_rank": None,
    "partial_rotary_factor": 1.0,
    "rope_scaling": None,
    "use_qk_norm": False,
    "hidden_act": "silu",
    "sliding_window_pattern": 2,
    "num_attention_groups": 1,
    "logits_scaling": 1.0,
    "attention_multiplier": 0.125,
    "embedding_multiplier": 1.0,
    "residual_multiplier": 1.0,
}


def model_types() -> list[str]:
    """Every module of ``mlx_lm.models`` (imported or not)."""
    return sorted(m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__))


def tiny_config(family: str) -> tuple[dict[str, Any] | None, str]:
    """The tiny config of ``family`` (TINY_FAMILIES' own where it has one), or None and
    why there is none."""
    if family in TINY_FAMILIES:
        extra = {"head_dim": 64} if family == "llama" else {}  # widths the codec stores
        return {**TINY_FAMILIES[family], **extra}, ""
    try:
        module = importlib.import_module(f"mlx_lm.models.{family}")
    except BaseException as exc:  # some modules exit when an extra package is missing
        return None, f"does not import: {type(exc).__name__}: {exc}"
    args = getattr(module, "ModelArgs", None)
    if args is None or not hasattr(module, "Model"):
        return None, "not a model (no ModelArgs / Model)"
    fields = {f.name: f for f in dataclasses.fields(args)}
    config = {k: v for k, v in COMMON.items() if k in fields}
    for name, value in REQUIRED_ONLY.items():
        f = fields.get(name)
        required = f is not None and f.default is dataclasses.MISSING
        if required and f is not None and f.default_factory is dataclasses.MISSING:
            config[name] = value
    if "text_config" in fields:
        return {"text_config": dict(COMMON)}, ""
    missing = [
        name
        for name, f in fields.items()
        if f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
        and name not in config
        and name not in ("model_type", "vocab_size", "max_position_embeddings")
    ]
    if missing:
        return None, f"needs {', '.join(missing)}"
    return _small(module, family, config)


def _small(module: Any, family: str, config: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """``config`` when its model is small (its defaults may make a big one: not "tiny"),
    or None and why. Building the module allocates nothing yet (MLX is lazy)."""
    try:
        fields = _tiny_fields(module.ModelArgs, family, config, 267)
        model = module.Model(module.ModelArgs(**fields))
    except Exception:
        return config, ""  # tiny_model says why
    flat: Any = tree_flatten(model.parameters())
    size = sum(v.size for _, v in flat)
    if size > MAX_PARAMETERS:
        return None, f"{size} parameters from its defaults: not a tiny model"
    return config, ""
