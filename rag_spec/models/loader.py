"""Load a local causal LM (embedded name or HF folder) onto the right device, once per process."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rag_spec.errors import RagSpecError
from rag_spec.models.embedded import gguf_name, pull
from rag_spec.models.registry import DEFAULT_MODEL, EMBEDDED_MODELS


@dataclass(frozen=True)
class LoadedModel:
    """A transformers causal LM with its tokenizer, ready for inference."""

    model: Any  # transformers PreTrainedModel, in eval mode
    tokenizer: Any  # transformers PreTrainedTokenizerBase
    name: str  # embedded name or folder path
    device: Any  # torch.device
    dtype: Any  # torch.dtype


_loaded: dict[tuple[str, str, str], LoadedModel] = {}
_lock = threading.Lock()


def resolve_device(device: str | None = None) -> Any:
    """``None`` or ``"auto"``: CUDA when present, else CPU. A device this machine or this torch
    build cannot use is a RagSpecError that names the alternatives."""
    import torch

    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as err:
        msg = f"Unknown device {device!r}; use cpu, cuda, cuda:N, mps or auto."
        raise RagSpecError(msg) from err
    if resolved.type == "cuda" and not torch.cuda.is_available():
        msg = (f"Device {device!r} asked for CUDA, but this torch ({torch.__version__}) sees no "
               "CUDA GPU; use --device cpu (or auto), or install a CUDA build of torch on a GPU "
               "machine.")
        raise RagSpecError(msg)
    if resolved.type == "cuda" and (resolved.index or 0) >= torch.cuda.device_count():
        msg = (f"Device {device!r} does not exist: this machine has "
               f"{torch.cuda.device_count()} CUDA device(s), cuda:0 to "
               f"cuda:{torch.cuda.device_count() - 1}.")
        raise RagSpecError(msg)
    if resolved.type == "mps" and not torch.backends.mps.is_available():
        msg = f"Device {device!r}: MPS (Apple GPUs) is not available here; use --device cpu."
        raise RagSpecError(msg)
    return resolved


def resolve_dtype(dtype: Any, device: Any) -> Any:
    """Default float32 on CPU, bfloat16 on CUDA; strings like ``"bfloat16"`` are accepted."""
    import torch

    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            msg = f"Unknown dtype {dtype!r}; use float32, bfloat16 or float16."
            raise RagSpecError(msg)
        return resolved
    return dtype


def load_model(name_or_path: str = DEFAULT_MODEL, *, device: str | None = None,
               dtype: Any = None) -> LoadedModel:
    """Load an embedded model by name, any local Hugging Face model folder, or a GGUF file.

    The same (model, device, dtype) is loaded once per process and shared.

    Examples:
        >>> lm = load_model("smollm2-135m-instruct")   # doctest: +SKIP
        >>> lm.model.device, lm.tokenizer.eos_token    # doctest: +SKIP
    """
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    key = (str(name_or_path), str(torch_device), str(torch_dtype))
    with _lock:
        if key not in _loaded:
            folder = _resolve_folder(str(name_or_path))
            _loaded[key] = _load_folder(folder, str(name_or_path), torch_device, torch_dtype)
        return _loaded[key]


def _resolve_folder(name_or_path: str) -> Path:
    """The folder to load (a GGUF file: the file itself)."""
    if name_or_path in EMBEDDED_MODELS:
        return pull(name_or_path)
    folder = Path(name_or_path).expanduser()
    if (folder / "config.json").is_file() or folder.suffix == ".gguf" and folder.is_file():
        return folder
    known = ", ".join(sorted(EMBEDDED_MODELS))
    msg = (f"{name_or_path!r} is neither an embedded model, a Hugging Face model folder (a "
           f"folder with config.json) nor a GGUF file. Embedded models: {known}; fetch one "
           f"with `rag-spec models pull NAME`, or pass the path of a local model folder or "
           f".gguf file. Models are never downloaded from a model hub.")
    raise RagSpecError(msg)


def _load_folder(folder: Path, name: str, device: Any, dtype: Any) -> LoadedModel:
    """Load a model folder, or a GGUF file (de-quantised by transformers; its quantised
    weights stay readable for ``LookaheadConfig(quantized=True)``, as the embedded model's)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rag_spec.target.gguf import chat_template, remember_file

    embedded = name in EMBEDDED_MODELS
    gguf_file = folder if folder.suffix == ".gguf" else None
    where = {"pretrained_model_name_or_path": folder.parent, "gguf_file": folder.name} if (
        gguf_file) else {"pretrained_model_name_or_path": folder}
    try:
        tokenizer = AutoTokenizer.from_pretrained(**where)
        # rag-spec writes embedded models as safetensors: anything else there is not ours
        model = AutoModelForCausalLM.from_pretrained(**where, dtype=dtype,
                                                     use_safetensors=True if embedded else None)
    except Exception as err:  # safetensors, unpickling refusals, configs: all mean unreadable
        fix = (f"run `rag-spec models pull --force {name}` to fetch and convert it again"
               if embedded else "check that it is a GGUF file transformers reads (the gguf "
               "package installed)" if gguf_file else
               "check that it holds config.json, the tokenizer files and the weights "
               "(*.safetensors)")
        msg = f"Could not load the model in {folder} ({_reason(err)}); {fix}."
        raise RagSpecError(msg) from err
    if gguf_file is not None and tokenizer.chat_template is None:
        tokenizer.chat_template = chat_template(gguf_file)  # the file's own, as llama.cpp uses
    if embedded:
        gguf_file = folder / gguf_name(EMBEDDED_MODELS[name])
    if gguf_file is not None:
        remember_file(model, gguf_file)
    model.to(device).eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, device=device, dtype=dtype)


def _reason(err: Exception) -> str:
    """The first line of a loading error, without advice that would load untrusted pickles."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    if "weights_only" in str(err) or "pickle" in str(err).lower():
        return f"{type(err).__name__}: the weights are not a readable safetensors file"
    return f"{type(err).__name__}: {text[:200]}" if text else type(err).__name__
