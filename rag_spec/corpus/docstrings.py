"""Docstrings read from this interpreter: the standard library, or installed packages.

They are read in a fresh child interpreter: libraries already imported here (transformers, for
one) patch standard-library classes, and the corpus must not depend on what happened to be
imported first, or its fingerprint, and so every saved index, would change from run to run.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import json
import pkgutil
import subprocess
import sys
import warnings
from collections.abc import Iterator
from types import ModuleType

# Modules with side effects on import (a browser, a GUI, printing) or nothing to document.
_SKIP = frozenset({
    "antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "lib2to3",
    "ensurepip", "pydoc_data", "msilib", "winreg", "winsound", "msvcrt", "nt",
})


def read_docstrings(source: str) -> list[tuple[str, str]]:
    """(dotted name, docstring) pairs of ``"stdlib"`` or ``"pkg:NAME"``, read in a child process."""
    cmd = [sys.executable, "-m", "rag_spec.corpus.docstrings", source]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True,
                          stdin=subprocess.DEVNULL)
    return [(title, text) for title, text in json.loads(done.stdout)]


def _documents(source: str) -> Iterator[tuple[str, str]]:
    if source == "stdlib":
        return stdlib_documents()
    return package_documents(source.removeprefix("pkg:"))


def stdlib_documents() -> Iterator[tuple[str, str]]:
    """(dotted name, docstring) for the public modules of the standard library and their members."""
    for name in sorted(sys.stdlib_module_names):
        if not name.startswith("_") and name not in _SKIP:
            module = _quiet_import(name)
            if module is not None:
                yield from module_documents(module)


def package_documents(package: str) -> Iterator[tuple[str, str]]:
    """(dotted name, docstring) for an installed package and all its importable submodules."""
    root = _quiet_import(package)
    if root is None:
        return
    yield from module_documents(root)
    for info in pkgutil.walk_packages(getattr(root, "__path__", []), prefix=f"{package}."):
        if not any(part.startswith("_") or part in _SKIP for part in info.name.split(".")):
            module = _quiet_import(info.name)
            if module is not None:
                yield from module_documents(module)


def module_documents(module: ModuleType) -> Iterator[tuple[str, str]]:
    """The module's own docstring, then its public classes, functions and methods."""
    name = module.__name__
    yield name, _own_doc(module)
    for attr, value in sorted(vars(module).items()):
        if attr.startswith("_") or getattr(value, "__module__", None) != name:
            continue
        if inspect.isclass(value):
            yield f"{name}.{attr}", _own_doc(value)
            for meth, member in sorted(vars(value).items()):
                if not meth.startswith("_") and callable(member):
                    yield f"{name}.{attr}.{meth}", _own_doc(member)
        elif inspect.isroutine(value):
            yield f"{name}.{attr}", _own_doc(value)


def _own_doc(obj: object) -> str:
    """The object's own docstring (not one inherited from a base class)."""
    doc = getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) else ""


def _quiet_import(name: str) -> ModuleType | None:
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except (Exception, SystemExit):  # a module that cannot import here has nothing to index
        return None


if __name__ == "__main__":
    json.dump(list(_documents(sys.argv[1])), sys.stdout)
