"""Reading the docs as the doc tests see them: fenced blocks and their marks, paragraphs with
their section, inline code spans, and calls / signatures written in code spans.

The conventions (docs/architecture.md, "Docs that are tested"):

* the line right before a fenced ``python`` block is ``<!-- runnable -->`` (the test runs it),
  ``<!-- fragment: examples/x.py -->`` (it must parse, its ``aiosync`` imports must resolve, and
  ``examples/x.py`` — the program that runs it — must exist) or, in docs/api.md,
  ``<!-- signature -->`` (each line is a signature checked against the code);
* a code span ``name(a, b=1, *, c=None)`` is a signature when it has a default or a ``*``: the
  same parameters, order, kinds and defaults as the code; ``=...`` stands for "has a default";
  a ``...`` parameter means "the rest is left out". ``name(a, b)`` with plain names only is a
  call: the code must accept it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^```\s*([\w+-]*)\s*$")
MARK = re.compile(r"^<!--\s*(runnable|fragment|signature)\s*(?::\s*(\S+?))?\s*-->$")
SPAN = re.compile(r"`([^`]+)`")
HEADING = re.compile(r"^(#+)\s+(.*)$")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it starts, its language, its text and the mark before it."""

    doc: str
    line: int
    lang: str
    text: str
    mark: str | None
    target: str | None

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


@dataclass(frozen=True)
class Paragraph:
    """A run of prose lines (a table row is one paragraph), with the heading it sits under."""

    doc: str
    line: int
    heading: str
    text: str

    def spans(self) -> list[str]:
        return [" ".join(s.split()) for s in SPAN.findall(self.text)]


def doc_name(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def blocks(text: str, doc: str = "<text>") -> list[Block]:
    out: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1).lower()
        i += 1
        body: list[str] = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        mark = MARK.match(lines[start - 1].strip()) if start else None
        out.append(Block(doc, start + 1, lang, "\n".join(body) + "\n",
                         mark.group(1) if mark else None, mark.group(2) if mark else None))
        i += 1  # the closing fence
    return out


def paragraphs(text: str, doc: str = "<text>") -> list[Paragraph]:
    """Prose outside fenced blocks, split at blank lines, headings and table rows."""
    out: list[Paragraph] = []
    heading, current, first = "", [], 0
    in_fence = False

    def flush() -> None:
        if current:
            out.append(Paragraph(doc, first + 1, heading, "\n".join(current)))
            current.clear()

    for n, line in enumerate(text.splitlines()):
        if line.startswith("```"):
            flush()
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        h = HEADING.match(line)
        if h:
            flush()
            heading = h.group(2).strip()
            continue
        if not line.strip() or line.lstrip().startswith("|"):
            flush()
            if line.strip():
                out.append(Paragraph(doc, n + 1, heading, line))
            continue
        if not current:
            first = n
        current.append(line)
    flush()
    return out


def headings(text: str) -> list[str]:
    """The headings of ``text`` outside fenced blocks."""
    out, in_fence = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        elif not in_fence and (h := HEADING.match(line)):
            out.append(h.group(2).strip())
    return out


def heading_at(text: str, line: int) -> str:
    """The heading ``line`` (1-based) sits under."""
    heading, in_fence = "", False
    for line_text in text.splitlines()[: line - 1]:
        if line_text.startswith("```"):
            in_fence = not in_fence
        elif not in_fence and (h := HEADING.match(line_text)):
            heading = h.group(2).strip()
    return heading


def read(path: Path) -> tuple[str, str]:
    return doc_name(path), path.read_text()


# --- calls and signatures written in code spans ---------------------------------------------------

PLAIN, KW_MARK, POS_MARK, VAR_POS, VAR_KW, OPEN = "plain", "*", "/", "*args", "**kw", "..."
NAME = re.compile(r"[A-Za-z_]\w*")


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # PLAIN, KW_MARK, POS_MARK, VAR_POS, VAR_KW or OPEN
    default: str | None = None  # the default's text; "..." = some default


@dataclass(frozen=True)
class Written:
    """``target(params)`` as written: ``params`` is None when the arguments are values (a call
    such as ``f(0, x=[1])``), not parameter names."""

    text: str
    target: str
    params: tuple[Param, ...] | None

    @property
    def is_signature(self) -> bool:
        """Beyond plain names: a default or a ``*`` / ``/`` mark makes it a signature."""
        return self.params is not None and any(p.default is not None or p.kind not in (PLAIN, OPEN)
                                               for p in self.params)


def _split_top(args: str) -> list[str] | None:
    parts, depth, cur, quote = [], 0, "", ""
    for ch in args:
        if quote:
            cur += ch
            quote = "" if ch == quote else quote
            continue
        if ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth < 0:
                return None
        elif ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
            continue
        cur += ch
    if depth or quote:
        return None
    if cur.strip():
        parts.append(cur.strip())
    return parts


def _param(item: str) -> Param | None:
    if item == "...":
        return Param("...", OPEN)
    if item in ("*", "/"):
        return Param(item, KW_MARK if item == "*" else POS_MARK)
    for prefix, kind in (("**", VAR_KW), ("*", VAR_POS)):
        if item.startswith(prefix) and NAME.fullmatch(item[len(prefix):]):
            return Param(item[len(prefix):], kind)
    if NAME.fullmatch(item):
        return Param(item, PLAIN)
    name, eq, default = item.partition("=")
    if eq and NAME.fullmatch(name.strip()) and default.strip():
        return Param(name.strip(), PLAIN, default.strip())
    return None


def parse_written(span: str) -> Written | None:
    """``span`` as one call or signature (``await``, ``async with ... as ...`` and ``-> ...``
    stripped), or None when it is not one."""
    text = span.strip()
    for prefix in ("async with ", "await ", "with ", "async "):
        if text.startswith(prefix):
            text = text[len(prefix):].strip()
    m = re.match(r"([A-Za-z_][\w.]*)\(", text)
    if not m:
        return None
    depth, end = 0, None
    for i in range(m.end() - 1, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            end = i
            break
    if end is None:
        return None
    rest = text[end + 1:].strip()
    if rest and not re.match(r"(->|as\b)", rest):
        return None  # an expression around a call, e.g. `f(x) + 1`
    items = _split_top(text[m.end():end])
    params = None
    if items is not None:
        parsed = [_param(item) for item in items]
        params = None if any(p is None for p in parsed) else tuple(parsed)
    return Written(span, m.group(1), params)
