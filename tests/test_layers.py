"""The package's shape: layers import only the layers below them, no module imports itself back
through a cycle, no file grows past what a reader holds in their head, and ``import aiosync``
stays cheap. Imports are read from the source (function-level imports included)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "aiosync"

#: Layer of each top-level part of the package; a module may import its own layer and those below.
LAYERS = {
    "errors": 0, "aio": 0, "messages": 0, "dtypes": 0, "_strict": 0, "configs": 0, "pieces": 0, "reclaim": 0,
    "transports": 1, "checkpoints": 1,
    "syncers": 2,
    "coordination": 3, "engines": 3,
    "runners": 4, "integrations": 4,
    "cli": 5,
}
#: Parts of one layer that must not import each other (siblings that know nothing of one another).
SEPARATE = {("transports", "checkpoints"), ("checkpoints", "transports"),
            # an engine is a model the syncers write (a CommitTarget): coordination never needs it
            ("coordination", "engines"), ("engines", "coordination")}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every aiosync module ``path`` imports, anywhere in it."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("aiosync")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("aiosync"):
                continue
            out.add(mod)
            for alias in node.names:  # `from . import x` may name a submodule
                if (PACKAGE.parent / (mod.replace(".", "/") + f"/{alias.name}.py")).exists():
                    out.add(f"{mod}.{alias.name}")
    return out


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        graph[name] = {m for m in _imports(path) if m in modules and m != name}
    return graph


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_layers_import_only_what_is_below_them():
    wrong = []
    for module, deps in _graph().items():
        part = _part(module)
        if part not in LAYERS:
            continue
        for dep in deps:
            dpart = _part(dep)
            if dpart == part or dpart == "":
                continue
            if LAYERS.get(dpart, 99) > LAYERS[part] or (part, dpart) in SEPARATE:
                wrong.append(f"{module} imports {dep}")
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(wrong))


def test_no_import_cycles():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    # a package's __init__ re-exporting its submodules is not a cycle of the design
    graph = {m: {d for d in deps if not (d.startswith(m + ".") and PACKAGE.joinpath(*m.split(".")[1:], "__init__.py")
                                         .exists())} for m, deps in graph.items()}
    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


#: The sub-packages of ``aiosync.syncers``, lowest first: each may import only those before it
#: (and the syncers' top level, ``base`` / ``config``, and the bottom layer). ``patch.ctx`` is part
#: of ``patch``.
SYNCER_FAMILIES = ["kernels", "common", "snapshot", "bucket", "patch"]
#: What each family may import of aiosync outside ``aiosync.syncers`` (the kernels: nothing at all).
# kernels: their loader thread runs at aiosync's worker priority (aio.lower_priority)
SYNCER_OUTSIDE = {"kernels": {"aio"}, "common": {"errors", "messages", "aio", "dtypes", "pieces", "_strict", "reclaim"}}
SYNCERS_TOP = 10  # entries at the top of aiosync/syncers (modules and sub-packages)


def _family(module: str) -> str | None:
    """The syncer family of ``module`` (``"top"`` for aiosync.syncers' own modules), or None."""
    parts = module.split(".")
    if parts[:2] != ["aiosync", "syncers"]:
        return None
    if len(parts) == 2 or (PACKAGE / "syncers" / f"{parts[2]}.py").exists():
        return "top"
    return parts[2]


def test_syncer_families_import_only_those_below_them():
    """kernels import no syncer, formats import no transport, a family imports only the families
    below it: the sub-packages of ``aiosync.syncers`` form a chain with no cycle between them."""
    wrong = []
    for module, deps in _graph().items():
        fam = _family(module)
        if fam is None:
            continue
        for dep in deps:
            if _part(dep) == "transports":
                wrong.append(f"{module} imports {dep} (syncers see only send/recv)")
            dfam = _family(dep)
            if fam in SYNCER_OUTSIDE and dfam is None and _part(dep) not in SYNCER_OUTSIDE[fam]:
                wrong.append(f"{module} imports {dep}")
            if dfam is None or dfam == fam or fam == "top" and dep.rpartition(".")[0] == "aiosync.syncers":
                continue
            if fam == "top":
                # the top level's own modules import no family (only the package's __init__ and the
                # test-only faults re-export what lies below)
                if module not in ("aiosync.syncers", "aiosync.syncers.faults"):
                    wrong.append(f"{module} imports {dep}")
                continue
            if dfam == "top":
                if fam == "kernels":
                    wrong.append(f"{module} imports {dep} (kernels import no syncer)")
                continue
            if SYNCER_FAMILIES.index(dfam) > SYNCER_FAMILIES.index(fam):
                wrong.append(f"{module} imports {dep} ({dfam} lies above {fam})")
    assert not wrong, "imports against the syncers' families:\n" + "\n".join(sorted(wrong))


def test_syncers_top_level_is_small_and_documented():
    entries = sorted(p.name for p in (PACKAGE / "syncers").iterdir()
                     if p.name != "__pycache__" and (p.suffix == ".py" or p.is_dir()))
    assert len(entries) <= SYNCERS_TOP, entries
    families = sorted(p.name for p in (PACKAGE / "syncers").iterdir() if p.is_dir() and p.name != "__pycache__")
    assert families == sorted(SYNCER_FAMILIES), families
    for init in (PACKAGE / "syncers").rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc, f"{init} has no docstring saying what lives there"
        if init.parent.name in SYNCER_FAMILIES:
            assert "May import" in doc, f"{init}'s docstring does not say what it may import"


def test_no_package_file_is_over_600_lines():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600}
    assert not long, f"files over 600 lines: {long}"


def test_import_aiosync_is_cheap_and_lazy():
    code = ("import sys, time; t = time.perf_counter(); import aiosync; dt = time.perf_counter() - t; "
            "heavy = [m for m in ('torch.distributed', 'numba', 'aiosync.syncers.kernels.flat', 'aiosync.coordination', "
            "'ray') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
    code = ("import sys, aiosync; aiosync.Synchronizer; aiosync.PatchWeightSyncer; "
            "print([m for m in ('torch.distributed.tensor', 'numba', 'aiosync.syncers.kernels.flat', 'ray') "
            "if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_every_public_name_resolves():
    import aiosync

    missing = [name for name in aiosync.__all__ if getattr(aiosync, name, None) is None]
    assert not missing, missing
