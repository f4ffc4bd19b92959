"""A GGUF file's quantised weights, as the quantised kernel takes them (``GroupQuantized``).

transformers' GGUF loader de-quantises a file into float32 layers; this module reads the same
file's blocks as they are (gguf's reader: memory-mapped, nothing de-quantised) for the layers
of a model loaded from it, so that the decoder can multiply by the file's own 4- and 8-bit
weights (``quantized_linear``). Q4_0, Q4_1, Q8_0, Q4_K and Q6_K blocks convert exactly to the
kernel's form (values, a scale, a minimum per 32 inputs, or 16; the K-quants' scales as their
small integers and the factor of each 256 inputs); Q6_K's 6-bit values are widened to 8 bits,
and its layers named in one log line. Other formats (Q5_K, the IQ quants ...) keep the
de-quantised float32 layer, and one log line names them.

Every converted weight is checked against the model's layer before it is used, on its first
and last outputs: their values, rounded once, must equal what transformers de-quantised (to a
rounding of the last bit); a layer that does not (a weight changed since loading, a tensor this
reader maps otherwise) keeps its float32 weights. The check reads those outputs alone, so the
float32 layers' other pages stay unread (``_checked``). The Llama family's files store the
query and key rows permuted for llama.cpp's rotary embedding; their rows are put back in
transformers' order, as its loader does.

Which models came from which file is remembered here, weakly, by the code that loaded them
(``remember_file``): a model's own attributes are never written. So are the layers that passed
the check, but not the blocks: they are memory-mapped, and the kernel packs its own copy, so
every page packing read would stay resident for nothing while a reference to them lived.

gguf's reader parses every token of a file's vocabulary before its tensors (seconds for a
small model's file), so a file's converted blocks are kept in rag-spec's cache, named by the
file's path, size and modification time: later processes load them instead
(``read_weights``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rag_spec_kernels import GroupQuantized

log = logging.getLogger(__name__)

# a GGUF layer's tensor name -> the module path of the Llama family's transformers layer
_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
_SOURCES: weakref.WeakKeyDictionary[Any, Path] = weakref.WeakKeyDictionary()
_PASSED: weakref.WeakKeyDictionary[Any, frozenset[str]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()
_FORMAT = 3  # the kept conversions' layout: a change here invalidates them


def remember_file(model: Any, path: str | Path) -> None:
    """Note that ``model`` was loaded from the GGUF file at ``path``."""
    with _lock:
        _SOURCES[model] = Path(path)


def source_file(model: Any) -> Path | None:
    """The GGUF file ``model`` was loaded from, if it was (and ``remember_file`` was told)."""
    return _SOURCES.get(model)


def chat_template(path: str | Path) -> str | None:
    """The chat template a GGUF file carries (``tokenizer.chat_template``), if it has one:
    transformers' GGUF tokenizer leaves it out."""
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get("tokenizer.chat_template")
    return None if field is None else str(field.contents())


def file_weights(model: Any) -> dict[str, GroupQuantized]:
    """The quantised weights of ``model``'s linear layers, by module path (``lm_head``,
    ``model.layers.0.self_attn.q_proj`` ...), from the GGUF file it was loaded from; empty
    where it was not. Checked against its layers once per model (module docstring); read on
    every call, from rag-spec's cache of the file's conversion where there is one (mapped,
    not copied), so the caller holds them only while it packs them."""
    path = source_file(model)
    if path is None:
        return {}
    with _lock:
        weights = read_weights(path, model.config)
        if model not in _PASSED:
            _PASSED[model] = frozenset(_checked(weights, model))
        return {module: w for module, w in weights.items() if module in _PASSED[model]}


def read_weights(path: str | Path, config: Any) -> dict[str, GroupQuantized]:
    """The Q4_0 / Q4_1 / Q8_0 weights of the Llama-family layers in the GGUF file at ``path``,
    by transformers module path, rows in transformers' order (``config``: the model's, for its
    head counts); from rag-spec's cache where an earlier process converted the same file."""
    kept = _kept_path(Path(path), config)
    if kept is not None and kept.is_file():
        try:
            return _load_kept(kept, Path(path))
        except Exception as err:  # noqa: BLE001 - a damaged copy: the file is read again
            log.warning("rag-spec: the converted blocks %s could not be read (%s: %s); "
                        "reading the GGUF file again", kept, type(err).__name__, err)
    weights, other = _converted(Path(path), config)
    if kept is not None:
        _keep(kept, weights, other)
    _name_others(other, Path(path))
    return weights


def _kept_path(path: Path, config: Any) -> Path | None:
    """Where ``path``'s converted blocks are kept (None: no cache on this machine)."""
    try:
        from rag_spec.paths import cache_dir

        folder = cache_dir() / "gguf-blocks"
    except ImportError:  # the decoder alone (make gpu-check): nothing is cached
        return None
    stat = path.stat()
    heads = [getattr(config, key, None) for key in (
        "model_type", "num_attention_heads", "num_key_value_heads")]
    digest = hashlib.blake2b(json.dumps(
        [_FORMAT, str(path.resolve()), stat.st_size, stat.st_mtime_ns, heads]).encode(),
        digest_size=12).hexdigest()
    return folder / f"{path.stem}.{digest}.safetensors"


def _keep(kept: Path, weights: dict[str, GroupQuantized], other: set[str]) -> None:
    from safetensors.torch import save_file

    from rag_spec.paths import atomic_file

    tensors, forms = {}, {}
    for module, weight in weights.items():
        for field in _TABLES:
            if getattr(weight, field) is not None:
                tensors[f"{module}.{field}"] = getattr(weight, field).contiguous()
        forms[module] = [weight.bits, weight.group]
    try:
        with atomic_file(kept) as scratch:
            save_file(tensors, str(scratch), metadata={"forms": json.dumps(forms),
                                                       "other": json.dumps(sorted(other))})
    except OSError as err:  # a read-only cache: the next process converts again
        log.info("rag-spec: could not keep the converted blocks at %s (%s)", kept, err)


def _load_kept(kept: Path, path: Path) -> dict[str, GroupQuantized]:
    from safetensors import safe_open

    with safe_open(str(kept), framework="pt") as file:
        meta = file.metadata()
        forms = json.loads(meta["forms"])
        names = set(file.keys())

        def table(module: str, field: str) -> torch.Tensor | None:
            name = f"{module}.{field}"
            return file.get_tensor(name) if name in names else None

        weights = {module: GroupQuantized(
            table(module, "values"), table(module, "scales"), table(module, "mins"), b, group,
            table(module, "scale_factors"), table(module, "min_factors"))
            for module, (b, group) in forms.items()}
    _name_others(set(json.loads(meta["other"])), path)
    return weights


def _name_others(other: set[str], path: Path) -> None:
    if other - _WIDENED.keys():
        log.info("rag-spec: %s layers of %s have no quantised kernel yet; they run "
                 "de-quantised to float32", ", ".join(sorted(other - _WIDENED.keys())),
                 path.name)
    for kind in sorted(other & _WIDENED.keys()):
        log.info("rag-spec: the %s layers of %s run on the %s", kind, path.name, _WIDENED[kind])


def _converted(path: Path, config: Any) -> tuple[dict[str, GroupQuantized], set[str]]:
    """The file's convertible weights, and the formats of those that have no kernel."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    names = {tensor.name for tensor in reader.tensors}
    weights: dict[str, GroupQuantized] = {}
    other: set[str] = set()  # formats without a kernel, and those widened for one
    for tensor in reader.tensors:
        module = _module_path(tensor.name, "output.weight" in names)
        if module is None:
            continue
        kind = tensor.tensor_type.name
        if kind not in _CONVERT or kind in _WIDENED:
            other.add(kind)
        if kind not in _CONVERT:
            continue
        weight = _CONVERT[kind](np.asarray(tensor.data))
        rows = _rows(tensor.name, weight.shape[0], config)
        weights[module] = weight if rows is None else weight.taken(rows)
    return weights, other


def _module_path(name: str, own_output: bool) -> str | None:
    if name == "output.weight" or name == "token_embd.weight" and not own_output:
        return "lm_head"  # a tied head reads the embedding table
    found = _NAME.fullmatch(name)
    if found is None or found[2] not in _LAYER:
        return None
    return f"model.layers.{found[1]}.{_LAYER[found[2]]}"


def _rows(name: str, out: int, config: Any) -> torch.Tensor | None:
    """The row order that undoes llama.cpp's permutation of a Llama query or key weight (the
    halves of each head's rotary pairs interleaved), or None for other tensors and families."""
    if getattr(config, "model_type", None) not in ("llama", "mistral") or not (
            ".attn_q." in name or ".attn_k." in name):
        return None
    heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
    return torch.arange(out).view(heads, out // heads // 2, 2).transpose(1, 2).reshape(-1)


def _halves(raw: np.ndarray, start: int) -> torch.Tensor:
    """Half-precision numbers at byte ``start`` of each block: (out, blocks)."""
    return torch.from_numpy(raw[..., start:start + 2].copy().view(np.float16)[..., 0])


def _nibbles(raw: np.ndarray, start: int) -> torch.Tensor:
    """A block's 16 bytes of 4-bit values as its 32 values (low halves first, as ggml
    stores them), (out, in)."""
    packed = raw[..., start:start + 16]
    values = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)
    return torch.from_numpy(values.reshape(raw.shape[0], -1).copy())


def _q4_0(data: np.ndarray) -> GroupQuantized:  # blocks of: scale, 16 bytes (values - 8)
    raw = data.reshape(data.shape[0], -1, 18)
    scale = _halves(raw, 0)
    return GroupQuantized(_nibbles(raw, 2), scale, scale * -8, 4)


def _q4_1(data: np.ndarray) -> GroupQuantized:  # blocks of: scale, minimum, 16 bytes
    raw = data.reshape(data.shape[0], -1, 20)
    return GroupQuantized(_nibbles(raw, 4), _halves(raw, 0), _halves(raw, 2), 4)


def _q8_0(data: np.ndarray) -> GroupQuantized:  # blocks of: scale, 32 signed bytes
    raw = data.reshape(data.shape[0], -1, 34)
    values = raw[..., 2:].copy().view(np.int8).reshape(raw.shape[0], -1)
    return GroupQuantized(torch.from_numpy(values), _halves(raw, 0), None, 8)


def _factors(raw: np.ndarray, start: int) -> torch.Tensor:
    """The half-precision number at byte ``start`` of each super-block, as float32:
    (out, blocks)."""
    return torch.from_numpy(raw[..., start:start + 2].copy().view(np.float16)[..., 0]).float()


def _q4_k(data: np.ndarray) -> GroupQuantized:
    """Super-blocks of 256: a scale and a minimum (half), 8 six-bit scales and minimums
    that multiply them (each 32 values' scale and minimum), 128 bytes of values, each 64 as
    one 32 in the low halves of 32 bytes and the next in the high."""
    from gguf.quants import Q4_K

    raw = data.reshape(data.shape[0], -1, 144)
    out, blocks = raw.shape[:2]
    scales, mins = (torch.from_numpy(part.reshape(out, -1).astype(np.int8))
                    for part in Q4_K.get_scale_min(raw[..., 4:16].reshape(-1, 12)))
    packed = raw[..., 16:].reshape(out, blocks, 4, 1, 32)
    values = (packed >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 0x0F
    return GroupQuantized(torch.from_numpy(values.reshape(out, -1).copy()), scales, mins, 4,
                          32, _factors(raw, 0), -_factors(raw, 2))


def _q6_k(data: np.ndarray) -> GroupQuantized:
    """Super-blocks of 256: 128 bytes of values' low 4 bits, 64 of their high 2 bits, 16
    signed scales (one per 16 values) and a scale (half) they multiply; each value less 32
    (6 bits, widened to 8)."""
    raw = data.reshape(data.shape[0], -1, 210)
    out, blocks = raw.shape[:2]
    low = raw[..., :128].reshape(out, blocks, 2, 1, 64) >> np.array(
        [0, 4], dtype=np.uint8).reshape(2, 1)
    low = (low & 0x0F).reshape(out, blocks, 2, 4, 32)
    high = raw[..., 128:192].reshape(out, blocks, 2, 1, 32) >> np.array(
        [0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    values = (low | (high & 0x03) << 4).astype(np.int8) - np.int8(32)
    scales = torch.from_numpy(raw[..., 192:208].copy().view(np.int8).reshape(out, -1))
    return GroupQuantized(torch.from_numpy(values.reshape(out, -1)), scales, None, 8, 16,
                          _factors(raw, 208))


_CONVERT = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q6_K": _q6_k}
# formats whose values a wider kernel form holds exactly: named once in the log
_WIDENED = {"Q6_K": "8-bit kernel (6-bit values widened)"}
_TABLES = ("values", "scales", "mins", "scale_factors", "min_factors")  # a weight's tensors
_CHECKED_ROWS = 8  # outputs at each end of a weight compared with the model's layer


def _checked(weights: dict[str, GroupQuantized], model: Any) -> dict[str, GroupQuantized]:
    """The weights that equal ``model``'s layers, de-quantised (to a last-bit rounding), on
    each one's first and last ``_CHECKED_ROWS`` outputs; the others are named in the log and
    left out (their layers keep float32). Sampled: a model loaded from a file maps its float32
    weights' pages in only as something reads them, and decoding the file's blocks reads none,
    so a whole check would hold them all in memory (rows spread over a weight would too: a
    fault maps the pages around it). A layer changed since it was loaded (trained, merged,
    replaced) differs on those rows too."""
    layers = dict(model.named_modules())
    kept: dict[str, GroupQuantized] = {}
    for path, weight in weights.items():
        layer = layers.get(path)
        float_weight = getattr(layer, "weight", None)
        if float_weight is None or tuple(float_weight.shape) != weight.shape:
            log.info("rag-spec: %s has no layer of the file's shape; it runs in float32", path)
            continue
        rows = torch.arange(weight.shape[0])
        rows = torch.cat([rows[:_CHECKED_ROWS], rows[_CHECKED_ROWS:][-_CHECKED_ROWS:]])
        expected = float_weight.detach()[rows].float()
        tolerance = 1e-6 * float(expected.abs().max()) + 1e-12
        sampled = weight.taken(rows)
        if float((sampled.dequantized(torch.float32) - expected).abs().max()) > tolerance:
            log.info("rag-spec: %s differs from the GGUF file it was loaded from (changed "
                     "since?); it runs on its float32 weights", path)
            continue
        kept[path] = weight
    return kept
