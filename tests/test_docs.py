"""The docs cannot drift from the code: every Python block of README.md and docs/*.md is marked
runnable (and runs here) or a fragment of a program that exists (and parses, its ``aiosync``
imports resolving); every ``aiosync`` command they show parses with the CLI's own parser; every
file, module path and link they name exists. The convention: docs/architecture.md, "Docs that
are tested". docs/api.md's names and signatures: test_docs_api.py."""

from __future__ import annotations

import ast
import importlib
import re
import shlex
import subprocess

import pytest
from docs_text import DOCS, ROOT, Block, blocks, headings, paragraphs, read

PYTHON = ("python", "py")
TOP_LEVEL_AWAIT = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT


def _missing_dependency(exc: ModuleNotFoundError) -> bool:
    """An optional dependency (ray, vllm) that is not installed, not a wrong aiosync path."""
    return bool(exc.name) and exc.name.split(".")[0] != "aiosync"


def import_problems(code: str) -> list[str]:
    """The ``aiosync`` imports of ``code`` that do not resolve."""
    problems = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            pairs = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            pairs = [(node.module or "", a.name) for a in node.names]
        else:
            continue
        for module, name in pairs:
            if module.split(".")[0] != "aiosync":
                continue
            try:
                mod = importlib.import_module(module)
                if name is not None and not hasattr(mod, name):
                    importlib.import_module(f"{module}.{name}")
            except ModuleNotFoundError as exc:
                if not _missing_dependency(exc):
                    problems.append(f"`{module}` has no {name or 'module'} ({exc})")
            except ImportError as exc:
                problems.append(f"cannot import {name!r} from `{module}` ({exc})")
    return problems


def block_problems(doc: str, text: str) -> list[str]:
    """What is wrong with the marks of ``text``'s fenced blocks, and with its fragments."""
    problems = []
    for b in blocks(text, doc):
        if b.lang not in PYTHON:
            if b.mark:
                problems.append(f"{b.where}: `{b.mark}` marks a {b.lang or 'plain'} block; "
                                "only Python blocks are marked")
            continue
        if b.mark is None:
            problems.append(f"{b.where}: unmarked Python block: put `<!-- runnable -->` or "
                            "`<!-- fragment: examples/<the program that runs it>.py -->` on the line before it")
        elif b.mark == "signature" and doc != "docs/api.md":
            problems.append(f"{b.where}: `signature` blocks are checked in docs/api.md only")
        elif b.mark == "fragment":
            if not b.target:
                problems.append(f"{b.where}: a fragment names the program that runs it: "
                                "`<!-- fragment: examples/x.py -->`")
                continue
            if not b.target.endswith(".py") or not (ROOT / b.target).is_file():
                problems.append(f"{b.where}: the fragment points to {b.target}, which does not exist")
            try:
                compile(b.text, b.where, "exec", flags=TOP_LEVEL_AWAIT, dont_inherit=True)
            except SyntaxError as exc:
                problems.append(f"{b.where}: the fragment is not valid Python: {exc}")
                continue
            problems += [f"{b.where}: {p}" for p in import_problems(b.text)]
        elif b.mark == "runnable" and b.target:
            problems.append(f"{b.where}: a runnable block names no program (`<!-- runnable -->`)")
    return problems


def run_block(block: Block) -> dict:
    """Run one runnable block as a script of its own; returns its namespace."""
    namespace = {"__name__": "__main__", "__file__": block.where}
    exec(compile(block.text, block.where, "exec", dont_inherit=True), namespace)  # noqa: S102 - the docs' own code
    return namespace


def _runnable() -> list[Block]:
    return [b for path in DOCS for b in blocks(*reversed(read(path))) if b.lang in PYTHON and b.mark == "runnable"]


def test_every_python_block_is_marked_and_every_fragment_points_to_a_program():
    problems = [p for path in DOCS for p in block_problems(*read(path))]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("block", _runnable(), ids=lambda b: b.where)
def test_runnable_block_runs(block):
    run_block(block)


def test_the_checks_fail_on_unmarked_blocks_missing_programs_and_bad_fragments():
    text = """```python
x = 1
```
<!-- fragment: examples/no_such_example.py -->
```python
x = 1
```
<!-- fragment: examples/quickstart.py -->
```python
f(a, *, b=1)
```
<!-- fragment: examples/quickstart.py -->
```python
from aiosync.coordination import NoSuchName
```
<!-- fragment: examples/quickstart.py -->
```python
await sync.drain()
```
"""
    problems = block_problems("t.md", text)
    assert len(problems) == 4, problems
    assert "t.md:1: unmarked Python block" in problems[0]
    assert "no_such_example.py, which does not exist" in problems[1]
    assert "not valid Python" in problems[2]  # a signature's `*,` inside a call
    assert "NoSuchName" in problems[3]


def test_a_runnable_block_that_raises_fails():
    (block,) = blocks("<!-- runnable -->\n```python\nimport aiosync\naiosync.no_such_name\n```\n", "t.md")
    with pytest.raises(AttributeError, match="no_such_name"):
        run_block(block)


# --- shell commands, files, module paths and links -----------------------------------------------

def _commands(text: str) -> list[str]:
    """Every `aiosync ...` command line in a text: in shell / plain blocks and in code spans."""
    lines = [line for b in blocks(text) if b.lang in ("", "bash", "sh", "console") for line in b.text.splitlines()]
    lines += [s for p in paragraphs(text) for s in p.spans()]
    out = []
    for line in lines:
        for part in re.split(r"&&|;|\|", line.split(" #")[0]):
            part = part.strip().removeprefix("$ ").strip()
            if re.match(r"aiosync (demo|bench|simulate)\b", part):
                out.append(part)
    return out


def cli_problems(text: str) -> list[str]:
    from aiosync.cli.main import build_parser

    problems = []
    for command in _commands(text):
        argv = shlex.split(command)[1:]
        try:
            build_parser().parse_args(argv)
        except SystemExit:
            problems.append(f"`{command}` is not a valid aiosync command line")
    return problems


def test_every_aiosync_command_shown_parses():
    problems = [f"{doc}: {p}" for path in DOCS for doc, text in [read(path)] for p in cli_problems(text)]
    assert not problems, "\n".join(problems)
    assert not cli_problems("`aiosync bench --quick`") and cli_problems("`aiosync bench --no-such-flag`")


def _repo_files() -> set[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return set(out.split())


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _anchors(path) -> set[str]:
    return {_slug(h) for h in headings(path.read_text())}


def reference_problems(doc: str, text: str, files: set[str]) -> list[str]:
    """Files (`x/y.py`, `tests/t.py::test`), `aiosync.` module paths and relative links that do not exist."""
    problems = []
    here = (ROOT / doc).parent
    for p in paragraphs(text, doc):
        where = f"{doc}:{p.line}"
        for span in p.spans():
            path, _, test = span.partition("::")
            if re.fullmatch(r"[\w./-]+\.py", path):
                hits = [f for f in files if f == path or f.endswith("/" + path)]
                if not hits:
                    problems.append(f"{where}: `{span}` names no file of the repository")
                elif test and not any(re.search(rf"def {re.escape(test)}\b", (ROOT / f).read_text()) for f in hits):
                    problems.append(f"{where}: {path} has no test `{test}`")
            elif re.fullmatch(r"aiosync(\.\w+)+", span):
                problems += [f"{where}: {e}" for e in _path_problems(span)]
        for target in re.findall(r"\]\(([^)\s]+)\)", p.text):
            if re.match(r"[a-z]+:", target):
                continue  # http:, https:, mailto:
            file, _, anchor = target.partition("#")
            dest = (here / file).resolve() if file else ROOT / doc
            if not dest.exists():
                problems.append(f"{where}: the link to {target} points to no file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                problems.append(f"{where}: {file or doc} has no section #{anchor}")
    return problems


def _path_problems(dotted: str) -> list[str]:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as exc:
            if _missing_dependency(exc):
                return []
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return [f"`{dotted}`: `{'.'.join(parts[:i])}` has no `{attr}`"]
            obj = getattr(obj, attr)
        return []
    return [f"`{dotted}` is no module"]


def test_every_file_module_path_and_link_named_exists():
    files = _repo_files()
    problems = [p for path in DOCS for p in reference_problems(*read(path), files)]
    assert not problems, "\n".join(problems)
    bad = reference_problems("docs/t.md", "`syncers/patch_sender.py`, `aiosync.syncers.nope`, [x](api.md#nope)", files)
    assert len(bad) == 3, bad
