"""The documentation's code: every ```python snippet in README.md and docs/*.md compiles, every name it
imports from lightning_horizon exists, and every name it uses is imported or defined in the snippet itself
(a user copies a snippet whole). Fast: nothing trains. Also the figures script's smoke test."""

import ast
import builtins
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)

# Placeholders a snippet may use for what the user already has (their module, their data, a step's
# arguments) without defining it; everything else must be imported or assigned in the snippet.
USER_OBJECTS = {"model", "datamodule", "data", "self", "batch", "batch_idx", "train_loader", "val_loader",
                "dataloader"}


def snippets():
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            line = text[: m.start()].count("\n") + 2
            yield pytest.param(page, line, m.group(1), id=f"{page.relative_to(ROOT)}:{line}")


def bound_and_used(tree):
    bound, used = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (used if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                bound.add((a.asname or a.name).split(".")[0])
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return bound, used


def check(source):
    """The faults of one snippet, as sentences (empty: it is complete)."""
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        return [f"does not compile: {e}"]
    faults = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lightning_horizon":
            try:
                mod = importlib.import_module(node.module)
            except ImportError as e:
                faults.append(f"import {node.module}: {e}")
                continue
            for a in node.names:
                if a.name != "*" and not hasattr(mod, a.name):
                    faults.append(f"`from {node.module} import {a.name}`: no such name")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "lightning_horizon":
                    try:
                        importlib.import_module(a.name)
                    except ImportError as e:
                        faults.append(f"import {a.name}: {e}")
    bound, used = bound_and_used(tree)
    missing = sorted(used - bound - set(dir(builtins)) - USER_OBJECTS)
    if missing:
        faults.append(f"uses names it never imports or defines: {', '.join(missing)}")
    return faults


@pytest.mark.parametrize("page,line,source", list(snippets()))
def test_snippet_is_complete(page, line, source):
    faults = check(source)
    assert not faults, f"{page.relative_to(ROOT)} line {line}: " + "; ".join(faults)


def test_public_imports_are_top_level():
    """A name in lightning_horizon.__all__ is imported from the top level on every page."""
    import lightning_horizon

    public = set(lightning_horizon.__all__)
    for page, line, source in (p.values for p in snippets()):
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_horizon."):
                for a in node.names:
                    assert a.name not in public, (
                        f"{page.relative_to(ROOT)} line {line}: `from {node.module} import {a.name}`; "
                        f"the public import is `from lightning_horizon import {a.name}`")


def test_the_check_fails_on_a_wrong_import():
    assert check("from lightning_horizon import NoSuchThing\n")
    assert check("from lightning_horizon.nosuchmodule import X\n")
    assert check("trainer = L.Trainer()\n")  # L never imported
    assert check("def f(:\n")
    assert not check("import lightning as L\nfrom lightning_horizon import HorizonStrategy\n"
                     "trainer = L.Trainer(strategy=HorizonStrategy())\n")


def test_local_links_resolve():
    """Every relative link and image in the pages points at a file that exists."""
    link = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
    for page in PAGES:
        for target in link.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)}: broken link {target}"


def test_docs_figures_smoke(tmp_path):
    """recipes/docs_figures.py --fast draws every figure (small, quick)."""
    r = subprocess.run([sys.executable, str(ROOT / "recipes" / "docs_figures.py"), "--fast", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    pngs = sorted(tmp_path.glob("*.png"))
    assert len(pngs) >= 5, pngs
    for p in pngs:
        assert 0 < p.stat().st_size < 150_000, (p, p.stat().st_size)
