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


FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
NEEDS = "# needs:"  # a block that needs what a fresh machine lacks says so in its first line
RUNNABLE = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _blocks(page: Path) -> list[tuple[int, str]]:
    text = page.read_text()
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in FENCE.finditer(text)]


def test_every_block_a_user_may_paste_compiles():
    for page in RUNNABLE:
        for line, code in _blocks(page):
            compile(code, f"{page.name}:{line}", "exec")


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("page", [p for p in RUNNABLE if _blocks(p)], ids=lambda p: p.name)
def test_every_block_runs_as_pasted_in_page_order(page, monkeypatch, user_cache, tmp_path):
    """One namespace a page, as one Python session a reader pastes each block into; run from
    a folder outside the checkout, as after ``pip install`` (a block reads only files it
    wrote itself); on the user's cache, as the other end-to-end tests, so the model and
    index are built once."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__main__"}
    ran = 0
    for line, code in _blocks(page):
        if not code.startswith(NEEDS):
            exec(compile(code, f"{page.name}:{line}", "exec"), namespace)  # noqa: S102
            ran += 1
    assert ran


def test_the_benchmarks_page_and_the_readme_table_are_rendered_from_the_json():
    from rag_spec.bench import page

    rendered = page.render(ROOT / "docs" / "benchmarks", ROOT / "README.md")
    for path, text in rendered.items():
        assert path.read_text() == text, f"{path} is stale: run python -m rag_spec.bench.page"
    assert len(list((ROOT / "docs" / "benchmarks").iterdir())) <= 40
    assert len(rendered[ROOT / "docs" / "benchmarks" / "README.md"].splitlines()) <= 600


def _reported(paths: list[Path]) -> set[str]:
    """Every number in these JSON files, as a page would write it."""
    numbers: set[str] = set()

    def walk(node):
        if isinstance(node, dict):
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
        elif isinstance(node, (int, float)) and not isinstance(node, bool):
            numbers.update({f"{node:.2f}", f"{node:.1f}", f"{node:.3f}"})

    for path in paths:
        walk(json.loads(path.read_text()))
    return numbers


def test_every_speedup_in_the_docs_is_in_the_json_its_paragraph_names():
    """A ratio written in README.md or docs/ (``2.31x``) is a value of a JSON its paragraph
    names (``lookahead.json``: docs/benchmarks/ or the lab's lab/results/); the README's
    generated table is checked by rendering it. Any number is in some JSON by chance: naming
    the file is what ties a figure to its run."""
    folders = [ROOT / "docs" / "benchmarks", ROOT / "lab" / "results"]
    unbacked = []
    for page in PAGES:  # a tutorial's markdown cells are comments: the file is one paragraph
        if page.parent.name == "benchmarks":
            continue  # rendered from the JSON beside it
        text = re.sub(r"<!-- how-fast.*?<!-- /how-fast -->", "", page.read_text(), flags=re.S)
        for paragraph in re.split(r"\n\s*\n", text) if page.suffix == ".md" else [text]:
            named = [f / f"{name}.json" for name in re.findall(r"(\w+)\.json", paragraph)
                     for f in folders if (f / f"{name}.json").is_file()]
            reported = _reported(named)
            unbacked += [f"{page.name}: {figure}x in {paragraph[:60]!r}"
                         for figure in re.findall(r"(?<![\w.])(\d+\.\d+)x\b", paragraph)
                         if figure not in reported]
    assert not unbacked, unbacked
