"""Documentation generated from the code stays in sync with it: docs/flags.md is what
scripts/gen_flags.py writes from the parser `--help` prints (run it after changing a flag)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from gen_flags import OUT, flags_markdown  # noqa: E402

from dpserve.launch_server import build_parser  # noqa: E402


def test_flag_reference_is_generated_from_the_parser(monkeypatch):
    monkeypatch.delenv("DPSERVE_API_KEY", raising=False)  # --api-key's default comes from it
    expected = flags_markdown(build_parser())
    assert OUT.read_text() == expected, "docs/flags.md is stale: run python scripts/gen_flags.py"
    for action in build_parser()._actions:  # every flag is documented
        for flag in action.option_strings:
            assert flag in ("-h", "--help") or f"`{flag}`" in expected, flag


# --- the names the docs cite exist --------------------------------------------------------------

import ast  # noqa: E402
import builtins  # noqa: E402
import re  # noqa: E402

PACKAGE = ROOT / "dpserve"
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
# A code span that names code: a path to a .py file or a package, `Name`, `Name.attr`, `module.name`
# or `name()` (snake_case words alone are as often JSON fields and metric names: not checked).
PATH = re.compile(r"^(?:dpserve/)?(?:[a-z_0-9]+/)*[a-z_0-9]+(?:\.py|/)$")
DOTTED = re.compile(r"^[A-Za-z_][A-Za-z_0-9]*(?:\.[A-Za-z_][A-Za-z_0-9]*)+(?:\(\))?$")
CLASS = re.compile(r"^_?[A-Z][a-z]+[A-Za-z0-9]*[a-z0-9][A-Za-z0-9]*$")  # CamelCase, not an ACRONYM
CALL = re.compile(r"^[a-z_][a-z_0-9]*\(\)$")


def _index() -> tuple[set[str], dict[str, set[str]], set[str]]:
    """(module paths relative to the package, members by class or module name, every defined name)."""
    modules, members, names = set(), {}, set()
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).with_suffix("")
        dotted = ".".join(rel.parts).removesuffix(".__init__")
        modules.add(dotted)
        tree = ast.parse(path.read_text())
        top = members.setdefault(rel.name if rel.name != "__init__" else rel.parent.name, set())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                own = members.setdefault(node.name, set())
                for sub in ast.walk(node):
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        own.add(sub.name)
                    elif isinstance(sub, ast.AnnAssign) and isinstance(sub.target, ast.Name):
                        own.add(sub.target.id)
                    elif isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
                        own.add(sub.attr)  # self.x = ...
                    elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                        own.add(sub.id)  # class constants, enum members
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
        for node in tree.body:  # a module's own names, for `module.name`
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                top.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                top.update(t.id for t in targets if isinstance(t, ast.Name))
    return modules, members, names


def _strings() -> set[str]:
    """Identifiers dpserve holds as strings (architectures it serves, JSON constants it reads)."""
    out = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                out.add(node.value)
    return out


FILES = {Path(p).name for p in PACKAGE.rglob("*.py")} | {p.name for p in (ROOT / "tests").glob("*.py")}


def _cited(span: str, modules: set[str], members: dict[str, set[str]], names: set[str]) -> bool | None:
    """Whether the code `span` names exists; None where it names nothing of dpserve's."""
    span = span.removesuffix("()")
    if span.endswith(".py") and "/" not in span:
        return span in FILES or (ROOT / "scripts" / span).exists()
    if "/" in span:
        if not PATH.match(span):
            return None
        rel = span.removeprefix("dpserve/")
        return (PACKAGE / rel).exists() or (ROOT / span).exists()
    if "." in span:
        parts = span.split(".")
        if parts[-1] in ("json", "jsonl", "png", "md", "txt", "safetensors", "gguf", "sh"):
            return None  # a data file
        if parts[0] == "dpserve":  # dpserve.module[.name]
            for cut in range(len(parts), 1, -1):
                if ".".join(parts[1:cut]) in modules:
                    rest = parts[cut:]
                    return not rest or rest[0] in members.get(parts[cut - 1], set())
            return False
        if ".".join(parts) in modules:
            return True
        if parts[0] not in members:
            return None  # another library's (torch, tl, os) or a JSON path
        owner, attr = parts[-2], parts[-1]
        return attr in members.get(owner, set())
    return span in names


def test_every_code_name_the_docs_cite_exists():
    """docs/*.md and the README name modules, classes and their members as code spans: each one
    exists in dpserve as written, so a rename that leaves the docs behind fails here."""
    modules, members, names = _index()
    names |= _strings() | set(dir(builtins)) | {"Infinity"}  # JSON's
    missing = []
    for doc in DOCS:
        for span in sorted(set(re.findall(r"`([^`\n]+)`", doc.read_text()))):
            if span.endswith(".md") or span.startswith(("scripts/", "tests/", "docs/", ".ci/")):
                continue
            checked = PATH.match(span) or DOTTED.match(span) or CLASS.match(span) or CALL.match(span)
            if checked and _cited(span, modules, members, names) is False:
                missing.append(f"{doc.name}: `{span}`")
    assert not missing, "the docs name code that does not exist:\n" + "\n".join(missing)
