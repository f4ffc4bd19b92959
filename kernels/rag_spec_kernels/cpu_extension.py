"""Our C++ CPU kernels (``streamed_linear.cpp``, ``quantized_linear.cpp``, ``tree_attention.cpp``,
``row_attention.cpp``, ``move_slots.cpp``):
the CPU implementations of the ``rag_spec_cpu`` operators, built for this machine on first use
by torch's extension loader (gcc and ninja, ~30 s once, then cached under torch's extension
root, ``$TORCH_EXTENSIONS_DIR`` where the user set it) and loaded into the process. They are
built for the vector instructions torch runs here: AVX-512 (every kernel; with VNNI where the
CPU has it) or AVX2 with FMA (all but the tree attention). Callers probe them
(``streamed_available``, ``cpu_attention_available``, ``row_attention_available``,
``slots_kernel_available``) and keep torch's kernels where they do not build."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType

import torch

_SOURCES = ("streamed_linear.cpp", "quantized_linear.cpp", "tree_attention.cpp",
            "row_attention.cpp", "move_slots.cpp", "bindings.cpp")
_build_lock = threading.Lock()
# compiler flags per instruction set torch reports (``get_cpu_capability``: its AVX512 means
# the F, DQ, BW and VL extensions)
_FLAGS = {"AVX512": ["-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c"],
          "AVX2": ["-mavx2", "-mfma", "-mf16c"]}


@functools.cache
def cpu_info() -> Mapping[str, str]:
    """This CPU as Linux describes it (the first processor's ``/proc/cpuinfo`` fields:
    ``vendor_id``, ``cpu family``, ``model``, ``model name``, ``flags`` ...); empty where not
    known (not Linux). One reader for what kernels choose by and benchmarks report; read-only,
    as every caller shares the one read."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return MappingProxyType(_first_processor(cpuinfo.read()))
    except OSError:
        return MappingProxyType({})


def _first_processor(text: str) -> dict[str, str]:
    """The fields of ``/proc/cpuinfo``'s first block (one block per logical processor)."""
    fields = (line.partition(":") for line in text.split("\n\n")[0].splitlines())
    return {key.strip(): value.strip() for key, colon, value in fields if colon}


def vector_flags() -> list[str]:
    """The vector instruction sets the CPU reports (AVX, AMX, FMA, F16C, SSE4), sorted."""
    return sorted(f for f in cpu_info().get("flags", "").split()
                  if f.startswith(("avx", "amx", "fma", "f16c", "sse4")))


def vector_isa() -> str | None:
    """The instruction set our kernels are built for here ("AVX512" or "AVX2"), or None where
    torch runs neither (an older or non-x86 CPU)."""
    isa = torch.backends.cpu.get_cpu_capability()
    return isa if isa in _FLAGS else None


def _extensions(isa: str) -> list[str]:
    """Compiler flags for the extensions of ``isa`` this CPU also has that a kernel uses:
    AVX-512 VNNI's byte dot products (``quantized_linear.cpp``)."""
    return ["-mavx512vnni"] if isa == "AVX512" and "avx512_vnni" in vector_flags() else []


@functools.cache
def cpu_extension() -> None:
    """Build (the first time) and load the kernels; raises where they cannot be built."""
    from torch.utils.cpp_extension import get_default_build_root, load

    isa = vector_isa()
    if isa is None:
        msg = ("rag-spec's CPU kernels need AVX2 or AVX-512; torch runs "
               f"{torch.backends.cpu.get_cpu_capability()} here")
        raise RuntimeError(msg)
    extensions = _extensions(isa)
    flags = [*_FLAGS[isa], *extensions]
    # one build per instruction set (and extension)
    name = "_".join(["rag_spec_cpu_kernels", isa.lower(), *(f[2:] for f in extensions)])
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()  # as torch's
    build = Path(root) / f"{name}-torch{torch.__version__}"
    build.mkdir(parents=True, exist_ok=True)
    with _build_lock, _builders_lock(build) as alone:
        if alone:  # torch's own lock file is a leftover: a process killed while building or
            # checking left it, and every later process would wait for it forever
            (build / "lock").unlink(missing_ok=True)
        if not (build / f"{name}.so").exists():
            print(f"rag-spec: building the CPU kernels for this machine in {build} "
                  "(once, ~30 s)", file=sys.stderr)
        here = Path(__file__).parent

        def built() -> None:
            # -fopenmp for at::parallel_for's pragma; its calls resolve to torch's own OpenMP
            # runtime (not linked here), so the kernels share torch's threads
            load(name=name, sources=[str(here / source) for source in _SOURCES],
                 build_directory=str(build), is_python_module=False,
                 extra_cflags=["-O3", *flags, "-fopenmp"])

        try:
            built()
        except OSError as err:  # a library the loader cannot read (a build killed while it
            # wrote it): its newer date keeps the build tool from redoing it, so it is removed
            if not (build / f"{name}.so").exists():  # not the library's fault (no compiler)
                raise
            print(f"rag-spec: the CPU kernels built in {build} could not be loaded ({err}); "
                  "building them again (~30 s)", file=sys.stderr)
            for output in (*build.glob("*.so"), *build.glob("*.o"), build / "build.ninja"):
                output.unlink(missing_ok=True)
            built()


@contextlib.contextmanager
def _builders_lock(build: Path) -> Iterator[bool]:
    """One process at a time builds or loads the kernels into ``build``: an advisory lock the
    kernel drops when its holder dies, so a killed build never blocks the next. Yields whether
    it is held (not where there is no ``fcntl``: torch's own lock alone)."""
    try:
        import fcntl
    except ImportError:
        yield False
        return
    with open(build / "rag-spec.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
