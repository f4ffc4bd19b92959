"""What a user reads imports only rag_spec's public names: tutorials, examples, the README and
the docs' snippets never reach into a sub-package (its layout is ours to change)."""

import ast
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import rag_spec

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
         *sorted((ROOT / "docs").rglob("*.py"))]


def test_the_docs_and_readme_import_no_sub_package():
    internal = [f"{page.relative_to(ROOT)}:{n}" for page in PAGES
                for n, line in enumerate(page.read_text().splitlines(), 1)
                if re.match(r"\s*(from|import)\s+rag_spec\.", line)]
    assert not internal, internal


def test_every_name_they_import_from_rag_spec_is_exported():
    imported = set()
    for page in PAGES:
        text = page.read_text()
        blocks = [text] if page.suffix == ".py" else re.findall(r"```python\n(.*?)```", text,
                                                                 re.S)
        for block in blocks:
            # tutorials await at the top level, as a notebook does
            tree = compile(textwrap.dedent(block), str(page), "exec",
                           flags=ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module == "rag_spec":
                    imported.update(alias.name for alias in node.names)
    assert imported and imported <= set(rag_spec.__all__), imported - set(rag_spec.__all__)


@pytest.mark.slow  # resolves every dependency against the package registry: seconds each
def test_the_install_commands_the_readme_gives_resolve_outside_make(tmp_path):
    """rag-spec from the checkout beside each partner (a partner alone cannot resolve: rag-spec
    is on no index)."""
    commands = re.findall(r"^pip install (\. .*?)\s*(?:#.*)?$", (ROOT / "README.md").read_text(),
                          re.M)
    assert len(commands) == 2
    for command in commands:
        report = tmp_path / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet",
                        "--ignore-installed", "--report", str(report), *command.split()],
                       cwd=ROOT, check=True, capture_output=True)
        installed = {i["metadata"]["name"] for i in json.loads(report.read_text())["install"]}
        assert "rag-spec" in installed and {Path(p).name for p in command.split()[1:]} \
            <= installed


def test_every_exported_name_is_in_the_api_reference():
    """rag_spec's names and the partner packages' (LangChain's, LlamaIndex's)."""
    import llama_index.embeddings.rag_spec as embeddings
    import llama_index.llms.rag_spec as llms
    import llama_index.retrievers.rag_spec as retrievers

    import langchain_rag_spec

    reference = (ROOT / "docs" / "configuration.md").read_text()
    documented = re.findall(r"^:::\s*([\w.]+)", reference, re.M)
    for package in (rag_spec, langchain_rag_spec, llms, retrievers, embeddings):
        names = {path.rsplit(".", 1)[-1] for path in documented
                 if path.startswith(package.__name__ + ".")}
        assert set(package.__all__) <= names, (package.__name__, set(package.__all__) - names)
