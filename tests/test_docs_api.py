"""docs/api.md against the code: every name imports from where the page's import table says,
every name the page uses is in that table (or a member of a class it names), and every
signature written there is the code's (``inspect.signature``: parameter names, order, kinds,
defaults). A call written with plain names, ``f(a, b)``, must be accepted by the code. The
conventions: docs/architecture.md, "Docs that are tested"."""

from __future__ import annotations

import builtins
import dataclasses
import importlib
import importlib.util
import inspect
import logging
import math
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from docs_text import (
    KW_MARK,
    OPEN,
    POS_MARK,
    ROOT,
    VAR_KW,
    VAR_POS,
    Written,
    blocks,
    heading_at,
    paragraphs,
    parse_written,
)

API = ROOT / "docs" / "api.md"
IMPORTS = "Where each name imports from"
#: The variables the page writes calls on, and what each one is.
RECEIVERS = {"sync": "Synchronizer", "handle": "TrainerHandle", "trainer": "TrainerHandle", "explorer": "Explorer",
             "slot": "PolicySlot", "r": "Rollout", "group": "WeightSyncGroup", "end": "SimulatedTransport",
             "target": "VLLMTarget", "peer": "ShardPeer", "config": "SynchronizerConfig",
             "wire": "aiosync.transports.distributed.wire"}
DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
CAMEL = re.compile(r"[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*")
P = inspect.Parameter


class Unresolved(Exception):
    pass


def import_table(text: str) -> dict[str, list[str]]:
    """name → the modules the page says it imports from (the table under IMPORTS)."""
    table: dict[str, list[str]] = {}
    for p in paragraphs(text):
        if p.heading == IMPORTS and p.text.startswith("|") and "`" in p.text:
            modules_cell, names_cell = p.text.strip().strip("|").split("|")[:2]
            modules = re.findall(r"`([^`]+)`", modules_cell)
            for name in re.findall(r"`([^`]+)`", names_cell):
                table.setdefault(name, []).extend(modules)
    return table


def _is_aiosync(module: str) -> bool:
    return module.split(".")[0] == "aiosync"


class MissingDependency(LookupError):
    """An optional dependency (ray) is not installed: what needs it is not checked here."""


def _import(module: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and not module.startswith(exc.name) and not _is_aiosync(exc.name):
            raise MissingDependency(exc.name) from exc
        raise


def table_problems(table: dict[str, list[str]]) -> list[str]:
    problems = []
    for name, modules in table.items():
        objects = []
        for module in modules:
            if not _is_aiosync(module):  # another project's name (vLLM's): installed, not imported here
                if importlib.util.find_spec(module.split(".")[0]) is None:
                    continue
                continue
            if module == "aiosync" and name not in importlib.import_module("aiosync").__all__:
                problems.append(f"`{name}` is not in `aiosync.__all__`")
                continue
            try:
                objects.append(getattr(_import(module), name))
            except MissingDependency:
                continue
            except (ImportError, AttributeError):
                problems.append(f"`from {module} import {name}` fails")
        if any(o is not objects[0] for o in objects[1:]):
            problems.append(f"`{name}` is not the same object in {modules}")
    return problems


def _instance_attribute(cls: type, attr: str) -> bool:
    """A field or an attribute ``__init__`` sets (``self.attr = ...``)."""
    for klass in cls.__mro__:
        if attr in getattr(klass, "__annotations__", {}):
            return True
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if re.search(rf"self\.{re.escape(attr)}\s*(:[^=\n]*)?=", source):
            return True
    return False


@dataclass
class Page:
    """Resolves the names of one page, with its import table and the page's variables."""

    table: dict[str, list[str]]
    problems: list[str] = field(default_factory=list)

    def named(self, name: str) -> Any:
        if name in self.table:
            module = next((m for m in self.table[name] if _is_aiosync(m)), None)
            if module is None:
                raise LookupError(name)  # another project's name
            return getattr(_import(module), name)
        raise Unresolved(f"`{name}` is not in the import table ({IMPORTS!r})")

    def dotted(self, parts: list[str]) -> tuple[Any, Any]:
        """(owner, object) of a dotted path that starts with a module."""
        for i in range(len(parts), 0, -1):
            try:
                obj = _import(".".join(parts[:i]))
            except ModuleNotFoundError:
                continue
            return self.walk(None, obj, parts[i:])
        raise Unresolved(f"`{'.'.join(parts)}` is no module")

    @staticmethod
    def walk(owner: Any, obj: Any, rest: list[str]) -> tuple[Any, Any]:
        for attr in rest:
            if hasattr(obj, attr):
                owner, obj = obj, getattr(obj, attr)
            elif inspect.isclass(obj) and _instance_attribute(obj, attr):
                raise LookupError(attr)  # set per instance: exists, nothing more to check
            else:
                raise Unresolved(f"`{getattr(obj, '__qualname__', obj)}` has no `{attr}`")
        return owner, obj

    def resolve(self, target: str, classes: list[type], callbacks: set[str]) -> tuple[Any, Any]:
        """(owner, object) that ``target`` names; LookupError: not aiosync's, nothing to check."""
        parts = target.split(".")
        head = parts[0]
        if head in RECEIVERS:
            receiver = RECEIVERS[head]
            if "." in receiver:
                return self.dotted(receiver.split(".") + parts[1:])
            return self.walk(None, self.named(receiver), parts[1:])
        if head in self.table:
            return self.walk(None, self.named(head), parts[1:])
        if len(parts) == 1:
            for cls in classes:
                if hasattr(cls, head):
                    return cls, getattr(cls, head)
            if head in callbacks or hasattr(builtins, head):
                raise LookupError(head)  # a callable a signature of this section takes, or a builtin
            raise Unresolved(f"`{head}` is no member of {[c.__name__ for c in classes] or 'a class named here'} "
                             f"and not in the import table ({IMPORTS!r})")
        if head != "aiosync" and head not in sys.modules:
            if importlib.util.find_spec(head) is None:
                raise Unresolved(f"`{target}`: no module `{head}`")
            raise LookupError(head)  # another project's, not imported here
        return self.dotted(parts)


def real_parameters(owner: Any, obj: Any) -> list[inspect.Parameter]:
    sig = inspect.signature(obj)
    params = list(sig.parameters.values())
    if inspect.isclass(owner) and not inspect.isclass(obj):
        static = inspect.getattr_static(owner, obj.__name__, None)
        if not isinstance(static, (staticmethod, classmethod)) and params and params[0].name in ("self", "cls"):
            params = params[1:]
    return [p for p in params if not p.name.startswith("_")]


def render(params: list[inspect.Parameter]) -> str:
    return str(inspect.Signature([p.replace(annotation=P.empty) for p in params]))


class _Defaults(dict):
    def __init__(self, page: Page):
        super().__init__(inf=math.inf, INFO=logging.INFO, DEBUG=logging.DEBUG)
        self.page = page

    def __missing__(self, name: str) -> Any:
        try:
            return self.page.named(name)
        except (Unresolved, LookupError):
            raise NameError(name) from None


def _same(doc: Any, real: Any) -> bool:
    if isinstance(doc, bool) or isinstance(real, bool):
        return type(doc) is type(real) and doc == real
    return doc is real or doc == real


def signature_problems(written: Written, owner: Any, obj: Any, page: Page) -> list[str]:
    """How ``written`` differs from the code's signature of ``obj``."""
    try:
        real = real_parameters(owner, obj)
    except (TypeError, ValueError):
        return []  # no signature to read (a C function)
    if not written.is_signature:  # a call with plain names: the code must accept it
        n = sum(1 for p in written.params if p.kind != OPEN)
        try:
            bind = inspect.Signature(real).bind_partial if any(p.kind == OPEN for p in written.params) else \
                inspect.Signature(real).bind
            bind(*range(n))
        except TypeError as exc:
            return [f"`{written.text}`: the code does not take that call ({exc}); its signature: {render(real)}"]
        return []
    doc: list[tuple[str, Any, str | None]] = []
    kind, open_at, after_open = P.POSITIONAL_OR_KEYWORD, None, []
    for p in written.params:
        if p.kind == OPEN:
            open_at = len(doc)
        elif open_at is not None:
            after_open.append(p.name)
        elif p.kind == KW_MARK:
            kind = P.KEYWORD_ONLY
        elif p.kind == POS_MARK:
            doc = [(n, P.POSITIONAL_ONLY, d) for n, _, d in doc]
        elif p.kind == VAR_POS:
            doc.append((p.name, P.VAR_POSITIONAL, None))
            kind = P.KEYWORD_ONLY
        elif p.kind == VAR_KW:
            doc.append((p.name, P.VAR_KEYWORD, None))
        else:
            doc.append((p.name, kind, p.default))
    wrong = []
    written_kinds = [(n, k) for n, k, _ in doc]
    if written_kinds != [(p.name, p.kind) for p in real[: len(doc)]]:
        wrong.append("other parameters, order or keyword-only marks")
    elif open_at is None and len(doc) != len(real):
        wrong.append(f"leaves out {', '.join(f'`{p.name}`' for p in real[len(doc):])}")
    else:
        for (name, _, default), p in zip(doc, real):
            if default is None and p.default is not P.empty:
                wrong.append(f"`{name}` has a default ({p.default!r})")
            elif default is not None and p.default is P.empty:
                wrong.append(f"`{name}` has no default")
            elif default not in (None, "...") and p.default is not P.empty:
                try:
                    value = eval(default, {"__builtins__": {}}, _Defaults(page))
                except Exception as exc:  # noqa: BLE001 - any failure to read a default is a doc problem
                    wrong.append(f"`{name}`'s default `{default}` cannot be read ({exc!r}); write `{name}=...`")
                    continue
                if not _same(value, p.default):
                    wrong.append(f"`{name}`'s default is {p.default!r}, not `{default}`")
    names = {p.name for p in real}
    wrong += [f"no parameter `{n}`" for n in after_open if n not in names]
    if wrong:
        return [f"`{written.text}`: {'; '.join(wrong)}; the code's signature: {render(real)}"]
    return []


def _heading_class(page: Page, heading: str) -> list[type]:
    m = re.match(r"`?([A-Za-z_]\w*)", heading)
    if m and m.group(1) in page.table:
        try:
            obj = page.named(m.group(1))
        except (Unresolved, LookupError):
            return []
        return [obj] if inspect.isclass(obj) else []
    return []


def _span_problems(page: Page, span: str, classes: list[type], callbacks: set[str], is_block: bool) -> list[str]:
    """What is wrong with one code span; the class it names goes first in ``classes`` (the
    context of the spans after it)."""
    written = parse_written(span)
    head = span.split(".")[0]
    if written is not None:
        def find():
            return page.resolve(written.target, classes, callbacks)
    elif DOTTED.fullmatch(span) and (head in page.table or head in RECEIVERS or head in sys.modules):
        def find():  # `PolicySlot.apply`, `sync.trainer`, `torch.cuda.Event`: it exists
            return page.resolve(span, classes, set())
    elif CAMEL.fullmatch(span) and not hasattr(builtins, span):
        def find():
            return None, page.named(span)
    else:
        return []
    try:
        owner, obj = find()
    except LookupError:
        return []
    except Unresolved as exc:
        return [str(exc)]
    if inspect.isclass(obj) or inspect.isclass(owner):
        classes.insert(0, obj if inspect.isclass(obj) else owner)
    if written is None or written.params is None:
        return []
    problems = [f"`{span}` in a signature block is not a signature"] if is_block and not written.is_signature else []
    return problems + signature_problems(written, owner, obj, page)


def page_problems(text: str, doc: str = "docs/api.md") -> list[str]:
    """Every name and signature of the page ``text`` checked against the code."""
    page = Page(import_table(text))
    problems = [f"{doc}: import table: {p}" for p in table_problems(page.table)]
    units: list[tuple[str, int, str, list[str], bool]] = []  # (heading, line, text, spans, is a signature block)
    for b in blocks(text, doc):
        if b.mark == "signature":
            units.append((heading_at(text, b.line), b.line, b.text, b.text.strip().splitlines(), True))
    units += [(p.heading, p.line, p.text, p.spans(), False) for p in paragraphs(text, doc) if p.heading != IMPORTS]
    callbacks: dict[str, set[str]] = {}
    for heading, _, _, spans, _ in units:  # the parameters each section's signatures take
        for span in spans:
            written = parse_written(span)
            if written is not None and written.is_signature:
                callbacks.setdefault(heading, set()).update(p.name for p in written.params)
    for heading, line, _, spans, is_block in units:
        classes = _heading_class(page, heading)
        for span in spans:
            problems += [f"{doc}:{line}: {p}" for p in
                         _span_problems(page, span, classes, callbacks.get(heading, set()), is_block)]
    return problems


def test_api_md_names_and_signatures_match_the_code():
    problems = page_problems(API.read_text())
    assert not problems, "\n".join(problems)


def test_metrics_section_names_every_statistic():
    from aiosync.coordination.session import ExplorerStatistics
    from aiosync.coordination.synchronizer import SynchronizerStatistics
    from aiosync.coordination.trainer import TrainerStatistics

    spans = {re.match(r"\w*", s).group() for p in paragraphs(API.read_text()) if p.heading == "Metrics (B6)"
             for s in p.spans()}  # `explorers[name]` names `explorers`
    assert spans, "docs/api.md has no section 'Metrics (B6)'"
    missing = {cls.__name__: [f.name for f in dataclasses.fields(cls) if f.name not in spans]
               for cls in (SynchronizerStatistics, TrainerStatistics, ExplorerStatistics)}
    assert not any(missing.values()), f"docs/api.md, Metrics (B6), does not name: {missing}"


def test_the_api_check_fails_on_wrong_imports_names_and_signatures():
    text = "\n".join([
        f"## {IMPORTS}", "", "| from | names |", "|---|---|",
        "| `aiosync.coordination`, `aiosync` | `Synchronizer`, `PolicySlot`, `StatusCell` |",
        "| `aiosync.coordination.shards` | `ShardPeer` |", "",
        "## Synchronizer", "", "<!-- signature -->", "```python",
        "Synchronizer(config=None, weight_syncer=None, *, transport_factory=None, loop_lag_interval=0.002)", "```", "",
        "`ShardPeer(model, transport, rank=None, *, names=None, timeout=600.0)`, `sync.drain(timeout=1)`,",
        "`PolicySlot(model, version=None, ...)` then `lease_nowait()`, `apply(write, *, nope=None)`, `NoSuchThing`,",
        "`sync.attach_explorer(name)`, `sync.attach_explorer(name, model)`.",
    ])
    problems = page_problems(text, "t.md")
    expected = ["`StatusCell` is not in `aiosync.__all__`",
                "loop_lag_interval=0.002)`: leaves out `fan_out`",
                ("`ShardPeer(model, transport, rank=None, *, names=None, timeout=600.0)`: other parameters, order or "
                 "keyword-only marks"),
                "`sync.drain(timeout=1)`: `timeout`'s default is None, not `1`",
                "`apply(write, *, nope=None)`: other parameters, order or keyword-only marks",
                "`NoSuchThing` is not in the import table",
                "`sync.attach_explorer(name)`: the code does not take that call"]
    for e in expected:
        assert any(e in p for p in problems), (e, problems)
    assert len(problems) == len(expected), problems
