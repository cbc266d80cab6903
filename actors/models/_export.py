"""A llama GGUF as an mlx-lm model directory, for peers that load only such folders
(``mlx_lm.load``, mlx-lm's server) to run the very same model.

The directory holds ``config.json`` (mlx-lm llama settings from :func:`_gguf.llama_args`),
``model.safetensors`` (every weight in float32, exactly the values kvactor's fp32 load
computes, under mlx-lm's names), the Hugging Face tokenizer files (``tokenizer.json``: the
byte-level BPE kvactor builds from the GGUF vocabulary, merges and special tokens;
``tokenizer_config.json`` with the chat template and special tokens; ``special_tokens_map.json``,
``generation_config.json``) and :data:`EXPORT_MARKER`, which marks the folder as an export
(so a later export may replace it) and records the source GGUF.

The weights keep the GGUF's q/k row order (llama.cpp's interleaved rotary pairs), so the
config says ``rope_traditional: true`` as kvactor's own GGUF load does: mlx-lm honours it
and computes bit for bit what kvactor computes; PyTorch transformers' llama ignores it and
would not.

Creates MLX arrays: call it on the thread that owns MLX (the CLI's main thread).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from tokenizers import Tokenizer as _RustTokenizer
from tokenizers import processors

from ..errors import ModelExportError, ModelLoadError
from . import _gguf
from ._bpe import ByteLevelBPETokenizer
from ._fetch import file_digest
from ._load import _to_fp32

__all__ = (
    "EXPORT_MARKER",
    "WEIGHTS_FILE",
    "ExportResult",
    "export_mlx_dir",
    "fp32_weights",
    "mlx_config",
    "tokenizer_files",
)

#: The file that marks a folder as this exporter's work (never read by mlx-lm).
EXPORT_MARKER = "kvactor-export.json"
WEIGHTS_FILE = "model.safetensors"
_FORMAT = 1  # bump when the exported files change: older exports are then redone
_TMP_PREFIX = ".kvactor-tmp-"
_MB = 1 << 20

Progress = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class ExportResult:
    """What :func:`export_mlx_dir` left in ``path``: file name -> bytes, the seconds it
    took, and whether an up-to-date earlier export was kept as it was (``reused``)."""

    path: Path
    files: dict[str, int]
    seconds: float
    reused: bool

    @property
    def total_bytes(self) -> int:
        """Bytes of every file of the export."""
        return sum(self.files.values())


def export_mlx_dir(
    gguf: Path, out: Path, *, force: bool = False, progress: Progress | None = None
) -> ExportResult:
    """Write ``out`` as an mlx-lm model directory holding the model of the llama GGUF
    ``gguf`` (weights in float32, tokenizer, chat template).

    ``out`` is created if missing. An earlier export (it has :data:`EXPORT_MARKER`) is
    replaced, or kept when it was made by this version from the same GGUF and is complete
    (unless ``force``). A non-empty folder that is not an export is refused unless
    ``force``: then the export's files are written into it, other files are left alone.
    Each file is written to a temporary name and renamed into place; the marker says
    ``"complete": true`` only once all are. ``progress`` receives one-line messages.

    Raises ModelExportError for a refused ``out`` or a failed write, ModelLoadError for a
    GGUF kvactor cannot load.
    """
    say = progress or (lambda _message: None)
    started = time.perf_counter()
    gguf = Path(gguf)
    out = Path(out).expanduser()
    previous = _check_target(out, force)
    try:
        digest = file_digest(gguf)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {gguf}: {exc}") from exc
    source = {"name": gguf.name, "sha256": digest}
    if previous is not None and not force and _up_to_date(out, previous, source):
        say(f"{out} is already an export of {gguf.name}: kept")
        kept = {str(k): int(v) for k, v in previous["files"].items()}
        return ExportResult(out, kept, time.perf_counter() - started, reused=True)

    say(f"reading {gguf}")
    try:
        tensors, metadata = _gguf.read_gguf(gguf)
        args = _gguf.llama_args(metadata, tensors)
        tokenizer = _gguf.tokenizer_from_metadata(metadata)
        weights = fp32_weights(args, tensors)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {gguf}: {exc}") from exc
    except ValueError as exc:
        raise ModelLoadError(f"{gguf}: {exc}") from exc
    del tensors
    texts = {
        "config.json": _json(mlx_config(args, tokenizer)),
        **tokenizer_files(tokenizer, metadata, int(args.max_position_embeddings or 2048)),
    }

    try:
        out.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(out, previous, keep=[*texts, WEIGHTS_FILE])
        stray = sorted(p.name for p in out.glob("model*.safetensors") if p.name != WEIGHTS_FILE)
        if stray:
            say(f"warning: {out} also holds {', '.join(stray)}, which mlx-lm would load too")
        marker: dict[str, Any] = {"kvactor_export": _FORMAT, "source": source, "complete": False}
        _write_file(out, EXPORT_MARKER, _json(marker).encode())
        files: dict[str, int] = {}
        for name, text in texts.items():
            files[name] = _write_file(out, name, text.encode("utf-8"))
        total = sum(w.nbytes for w in weights.values())
        say(f"writing {WEIGHTS_FILE}: {len(weights)} float32 tensors, {total / _MB:.0f} MB")
        files[WEIGHTS_FILE] = _write_file(
            out, WEIGHTS_FILE, lambda f: _write_safetensors(f, weights, say)
        )
        _write_file(out, EXPORT_MARKER, _json({**marker, "complete": True, "files": files}))
        _fsync_dir(out)
    except OSError as exc:
        raise ModelExportError(f"cannot write {out}: {exc}") from exc
    seconds = time.perf_counter() - started
    say(f"exported {gguf.name} to {out} ({sum(files.values()) / _MB:.0f} MB, {seconds:.1f} s)")
    return ExportResult(out, files, seconds, reused=False)


# ---------------------------------------------------------------- what the files hold


def fp32_weights(args: llama.ModelArgs, tensors: Mapping[str, mx.array]) -> dict[str, mx.array]:
    """Every parameter of the model as kvactor's fp32 load holds it (built by
    :func:`_gguf.build_llama`, then dequantized and cast by ``model._to_fp32``), under the
    names mlx-lm's llama loads (``model.layers.0.self_attn.q_proj.weight`` ...).

    Lazy arrays: each is computed when it is evaluated. Raises ValueError for tensors that
    do not fit a llama model.
    """
    model = _gguf.build_llama(args, dict(tensors))
    _to_fp32(model)
    flat: Any = tree_flatten(model.parameters())
    weights = dict(sorted(flat))
    odd = [name for name, w in weights.items() if w.dtype != mx.float32]
    if odd:  # _to_fp32 casts everything; anything else is a bug worth stopping for
        raise ValueError(f"not float32 after the fp32 conversion: {odd[:3]}")
    return weights


def mlx_config(args: llama.ModelArgs, tokenizer: ByteLevelBPETokenizer) -> dict[str, Any]:
    """``config.json`` for mlx-lm's llama: the fields of ``args`` (``rope_traditional``
    included; ``layer_types``, derived from the layer count, and unset fields left out),
    the architecture name and the BOS/EOS ids."""
    fields = {
        k: v
        for k, v in dataclasses.asdict(args).items()
        if v is not None and k != "layer_types" and not k.startswith("_")
    }
    config: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], **fields}
    config["hidden_act"] = "silu"
    if tokenizer.bos_token_id is not None:
        config["bos_token_id"] = tokenizer.bos_token_id
    eos = sorted(tokenizer.eos_token_ids)
    if eos:
        config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return config


def tokenizer_files(
    tokenizer: ByteLevelBPETokenizer, metadata: dict[str, Any], context_length: int
) -> dict[str, str]:
    """The Hugging Face tokenizer files (name -> text) of ``tokenizer`` (built by
    :func:`_gguf.tokenizer_from_metadata` from ``metadata``): ``tokenizer.json`` is the
    very tokenizer kvactor encodes with, plus a post-processor adding BOS/EOS when the GGUF
    asks for them; ``tokenizer_config.json`` holds the chat template and the special
    tokens that templates see (``bos_token``: the BOS text, ``eos_token``: the text of the
    lowest EOS id, as kvactor renders them), ``generation_config.json`` every EOS id.
    """
    texts = metadata["tokenizer.ggml.tokens"]  # as kvactor's templates see them
    bos = tokenizer.bos_token_id
    eos = sorted(tokenizer.eos_token_ids)
    add_bos = bool(_gguf.scalar(metadata, "tokenizer.ggml.add_bos_token", False))
    add_eos = bool(_gguf.scalar(metadata, "tokenizer.ggml.add_eos_token", False))

    rust = _RustTokenizer.from_str(tokenizer.to_json())
    prefix = [texts[bos]] if add_bos and bos is not None else []
    suffix = [texts[eos[0]]] if add_eos and eos else []
    if prefix or suffix:
        ends = [(t, rust.token_to_id(t)) for t in dict.fromkeys(prefix + suffix)]
        rust.post_processor = processors.TemplateProcessing(
            single=[*prefix, "$A", *suffix],
            pair=[*prefix, "$A", *suffix, *prefix, "$B:1", *suffix],
            special_tokens=ends,
        )

    specials: dict[str, str] = {}
    if bos is not None:
        specials["bos_token"] = texts[bos]
    if eos:
        specials["eos_token"] = texts[eos[0]]
    for key, role in (("unknown_token_id", "unk_token"), ("padding_token_id", "pad_token")):
        value = _gguf.scalar(metadata, f"tokenizer.ggml.{key}")
        if value is not None and 0 <= int(value) < len(texts):
            specials[role] = texts[int(value)]
    config: dict[str, Any] = {
        # The tokenizer.json as it is. Without a class, transformers may pick one from
        # config.json's model_type (llama), and such a class may build its own pre-tokenizer.
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
    }
    template = metadata.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    generation: dict[str, Any] = {}
    if bos is not None:
        generation["bos_token_id"] = bos
    if eos:
        generation["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if "pad_token" in specials:
        generation["pad_token_id"] = int(_gguf.scalar(metadata, "tokenizer.ggml.padding_token_id"))
    return {
        "tokenizer.json": rust.to_str(pretty=True),
        "tokenizer_config.json": _json(config),
        "special_tokens_map.json": _json(specials),
        "generation_config.json": _json(generation),
    }


# ---------------------------------------------------------------- the target folder


def _check_target(out: Path, force: bool) -> dict[str, Any] | None:
    """The marker of an earlier export in ``out``, or None (``out`` missing or empty, or
    ``force``d). Raises ModelExportError for an ``out`` we may not write into."""
    if out.exists() and not out.is_dir():
        raise ModelExportError(f"{out} exists and is not a directory")
    try:
        if not out.is_dir() or not any(out.iterdir()):
            return None
    except OSError as exc:
        raise ModelExportError(f"cannot list {out}: {exc}") from exc
    marker = _read_marker(out)
    if marker is None and not force:
        raise ModelExportError(
            f"{out} is not empty and is not a kvactor export ({EXPORT_MARKER} is missing); "
            "choose an empty or new directory, or pass --force to write into it anyway"
        )
    return marker


def _read_marker(out: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((out / EXPORT_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or "kvactor_export" not in marker:
        return None
    return marker


def _up_to_date(out: Path, marker: Mapping[str, Any], source: Mapping[str, str]) -> bool:
    files = marker.get("files")
    if (
        marker.get("kvactor_export") != _FORMAT
        or marker.get("complete") is not True
        or marker.get("source") != dict(source)
        or not isinstance(files, dict)
        or not files
    ):
        return False
    for name, size in files.items():
        path = out / str(name)
        if not path.is_file() or path.stat().st_size != size:
            return False
    return True


def _remove_leftovers(out: Path, previous: Mapping[str, Any] | None, keep: list[str]) -> None:
    """Temporary files of an interrupted export; an earlier export's files this one does
    not write again. Nothing else is touched."""
    for path in out.glob(f"{_TMP_PREFIX}*"):
        path.unlink(missing_ok=True)
    if previous is None:
        return
    old = previous.get("files")
    for name in old if isinstance(old, dict) else ():
        if name not in keep and name != EXPORT_MARKER and Path(str(name)).name == name:
            (out / str(name)).unlink(missing_ok=True)


# ---------------------------------------------------------------- writing


def _json(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False) + "\n"


def _write_file(
    directory: Path, name: str, content: bytes | str | Callable[[BinaryIO], None]
) -> int:
    """Write ``directory/name`` atomically (a temporary file, fsync, rename); return its
    size. ``content`` is the bytes, or a function writing them to the open file."""
    fd, tmp = tempfile.mkstemp(prefix=f"{_TMP_PREFIX}{name}.", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(content):
                content(f)
            else:
                f.write(content.encode("utf-8") if isinstance(content, str) else content)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a model folder is meant to be shared
        os.replace(tmp, directory / name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return (directory / name).stat().st_size


def _write_safetensors(f: BinaryIO, weights: Mapping[str, mx.array], say: Progress) -> None:
    """``weights`` (float32) as one safetensors file, tensor by tensor in name order, each
    computed just before it is written; ``say`` hears every tenth of the bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for name, w in weights.items():
        header[name] = {
            "dtype": "F32",
            "shape": list(w.shape),
            "data_offsets": [offset, offset + w.nbytes],
        }
        offset += w.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keeps every tensor 8-byte aligned
    f.write(len(raw).to_bytes(8, "little") + raw)
    done = 0
    shown = 0
    offset = max(offset, 1)
    for w in weights.values():
        mx.eval(w)
        array = np.ascontiguousarray(np.asarray(w), dtype="<f4")
        f.write(array.data.cast("B") if array.size else b"")
        done += array.nbytes
        if done * 10 // offset > shown or done == offset:
            shown = done * 10 // offset
            say(f"  {WEIGHTS_FILE}: {100 * done // offset:3d}% ({done / _MB:.0f} MB)")


def _fsync_dir(directory: Path) -> None:
    """Makes the renames into ``directory`` durable (where the OS allows opening it)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
