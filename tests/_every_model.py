"""Tiny configurations of every mlx-lm model type that can be built from common fields
(``tests/test_every_model.py``): each ``ModelArgs`` field named in :data:`COMMON` takes
its value (those in :data:`REQUIRED_ONLY` only where the field has no default), the rest
keep their defaults; a type with another required field has none, with its reason. And
what each model type does today (:data:`OUTCOMES`), pinned: a family that runs must not
start being refused, nor a refused one be skipped, without the test failing."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import Any

import mlx.core as mx
import mlx_lm.models
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from kvactor.actors.models._load import _tiny_fields
from kvactor.actors.models._tiny import TINY_FAMILIES

#: What each model type of mlx-lm 0.32 does with its tiny config (measured 2026-12-03 on
#: mlx-lm 0.32.x): a turn runs in both attention modes; open() refuses it in both, naming
#: its family (ModelLoadError); kvactor's geometry probe refuses it naming the layer; it
#: has no tiny config (another required field, not a model, too big from its defaults, or
#: its module does not import: ``olmo`` needs the ``ai2-olmo`` package); or mlx-lm itself
#: cannot build it or run it over its own caches from that config.
RUNS = frozenset(
    {
        "Klear", "bailing_moe", "cohere", "deepseek", "deepseek_v2", "dots1", "ernie4_5",
        "ernie4_5_moe", "falcon_h1", "gemma", "gemma3_text", "gemma4_text", "glm", "glm4",
        "glm4_moe", "gpt2", "gpt_neox", "gpt_oss", "gptj", "granite", "granitemoe",
        "granitemoehybrid", "helium", "hunyuan_v1_dense", "internlm2", "internlm3", "laguna",
        "lfm2", "lille-130m", "llama", "mamba2", "mimo", "mistral3", "mixtral", "muse_glimmer",
        "nanbeige", "nanochat", "nemotron", "nemotron_h", "olmo2", "olmo3", "olmoe", "phi",
        "phi3", "phimoe", "pixtral", "plamo3", "qwen2", "qwen2_moe", "qwen2_vl", "qwen3",
        "qwen3_5", "qwen3_moe", "qwen3_next", "qwen3_vl", "qwen3_vl_moe", "seed_oss",
        "smollm3", "solar_open", "stablelm", "starcoder2", "talkie", "telechat3", "youtu_llm",
    }
)  # fmt: skip
REFUSED_AT_OPEN = frozenset(
    {
        "bailing_moe_v3", "deepseek_v3", "gemma2", "glm4_moe_lite", "gpt_bigcode", "kimi_k25",
        "kimi_linear", "kimi_vl", "minimax_m3_vl",
    }
)  # fmt: skip
REFUSED_BY_PROBE = frozenset({"deepseek_v41", "iquestloopcoder"})
NO_CONFIG = frozenset(
    {
        "activations", "afm7", "afmoe", "apertus", "baichuan_m1", "bailing_hybrid",
        "bailing_moe_linear", "base", "bitlinear_layers", "cache", "dbrx", "deepseek_v32",
        "exaone_moe", "gated_delta", "gear", "glm_moe_dsa", "hunyuan", "jamba", "lfm2_moe",
        "llama4_text", "longcat_flash", "longcat_flash_ngram", "mamba", "mellum",
        "mimo_v2_flash", "minicpm", "minicpm3", "minimax", "mla", "olmo", "olmo_hybrid",
        "openelm", "phi3small", "phixtral", "pipeline", "plamo2", "recurrent_gemma",
        "rope_utils", "rwkv7", "spark2_5", "ssm", "switch_layers",
    }
)  # fmt: skip
MLX_CANNOT = frozenset(
    {
        "bitnet", "cohere2", "exaone", "exaone4", "gemma3", "gemma3n", "gemma4", "kimi_k3",
        "lfm2-vl", "llama4", "ministral3", "mistral4", "muse_spark", "nemotron-nas", "plamo",
        "prism_hadamard_qwen35", "qwen", "qwen3_5_moe", "step3p5",
    }
)  # fmt: skip
OUTCOMES: dict[str, str] = {
    **{f: "runs" for f in RUNS},
    **{f: "refused at open" for f in REFUSED_AT_OPEN},
    **{f: "refused by the probe" for f in REFUSED_BY_PROBE},
    **{f: "no tiny config" for f in NO_CONFIG},
    **{f: "mlx-lm cannot" for f in MLX_CANNOT},
}

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


def mlx_lm_runs(family: str, config: dict[str, Any]) -> str | None:
    """Why mlx-lm alone cannot build ``family`` from ``config`` and run three tokens over
    its own caches (``make_prompt_cache``), or None when it can: kvactor not involved."""
    try:
        module = importlib.import_module(f"mlx_lm.models.{family}")
        fields = _tiny_fields(module.ModelArgs, family, config, 267)
        model = module.Model(module.ModelArgs(**fields))
        cache = make_prompt_cache(model)
        model(mx.array([[1, 2]], dtype=mx.uint32), cache=cache)
        mx.eval(model(mx.array([[3]], dtype=mx.uint32), cache=cache))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


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
