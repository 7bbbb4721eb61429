"""The Python code blocks of README.md and docs/*.md run as written.

A block runs as a script (``__name__ == "__main__"``) in a fresh namespace, then every
``test_*`` function it defines is called (coroutine functions under ``asyncio.run``), as pytest
would. A block preceded by the line ``<!-- no-run -->`` is a fragment and is skipped.
"""

from __future__ import annotations

import asyncio
import inspect
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NO_RUN = "<!-- no-run -->"
PYTHON = frozenset({"python", "py", "python3"})
_OPEN = re.compile(r"^ {0,3}(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")

#: documents owned elsewhere whose fragments still lack the ``<!-- no-run -->`` marker:
#: their blocks are run, and expected to fail to compile (not to be silently skipped)
#: documents with a known fragment that cannot run as written (document -> reason)
UNMARKED_FRAGMENTS: dict[str, str] = {}


@dataclass(frozen=True)
class Block:
    document: str
    #: 1-based line number of the opening fence
    line: int
    language: str
    code: str
    runnable: bool

    @property
    def name(self) -> str:
        return f"{self.document}:{self.line}"


def extract_blocks(text: str, document: str = "<text>") -> list[Block]:
    """Every fenced code block of a Markdown text, with its language and run marker."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _OPEN.match(lines[i])
        if opening is None:
            i += 1
            continue
        fence = opening["fence"]
        closing = re.compile(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        info = opening["info"].split()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not closing.match(lines[i]):
            body.append(lines[i])
            i += 1
        i += 1  # past the closing fence
        previous = next((ln.strip() for ln in reversed(lines[:start]) if ln.strip()), "")
        blocks.append(
            Block(
                document=document,
                line=start + 1,
                language=info[0].lower() if info else "",
                code="\n".join(body) + "\n",
                runnable=previous != NO_RUN,
            )
        )
    return blocks


def _documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _python_blocks() -> list[Block]:
    found: list[Block] = []
    for path in _documents():
        document = path.relative_to(ROOT).as_posix()
        blocks = extract_blocks(path.read_text(encoding="utf-8"), document)
        found.extend(b for b in blocks if b.language in PYTHON)
    return found


def _params() -> list[object]:
    params: list[object] = []
    for block in _python_blocks():
        if not block.runnable:
            continue
        marks = []
        if block.document in UNMARKED_FRAGMENTS:
            reason = UNMARKED_FRAGMENTS[block.document]
            marks.append(pytest.mark.xfail(reason=reason, raises=SyntaxError, strict=False))
        params.append(pytest.param(block, id=block.name, marks=marks))
    return params


def run_block(block: Block) -> None:
    """Run ``block`` as a script, then the ``test_*`` functions it defines."""
    filename = f"{ROOT / block.document}:{block.line}"
    code = compile(block.code, filename, "exec")
    namespace: dict[str, object] = {"__name__": "__main__", "__file__": filename}
    exec(code, namespace)
    for name, value in list(namespace.items()):
        if not (name.startswith("test_") and inspect.isfunction(value)):
            continue
        if value.__code__.co_filename != filename:
            continue  # imported, not defined here
        if inspect.iscoroutinefunction(value):
            asyncio.run(value())
        else:
            value()


@pytest.mark.model
@pytest.mark.timeout(180)
@pytest.mark.parametrize("block", _params())
def test_python_block_runs_as_written(block: Block) -> None:
    """Every Python block not marked ``<!-- no-run -->`` runs without raising, and so do the
    ``test_*`` functions it defines: what the documentation shows is what the code does."""
    run_block(block)


def test_documents_have_runnable_python_blocks() -> None:
    """The README's example and each guide's examples are collected as runnable: a broken
    extractor (or a stray marker) cannot silently turn the block tests into no tests."""
    runnable = {b.document for b in _python_blocks() if b.runnable}
    for document in ("README.md", "docs/embedding.md", "docs/supervision-testing.md"):
        assert document in runnable, f"no runnable Python block found in {document}"


def test_no_run_marker_applies_only_to_the_next_block() -> None:
    """The marker skips exactly the fenced block that follows it (blank lines allowed); blocks
    keep their language, line and code; other languages are collected but not Python."""
    text = "\n".join(
        [
            "Intro.",
            "```python",
            "print('runs')",
            "```",
            NO_RUN,
            "",
            "```python",
            "await fragment()",
            "```",
            "````sh",
            "echo '```'",
            "````",
            "```py",
            "x = 1",
            "```",
        ]
    )
    blocks = extract_blocks(text, "doc.md")
    assert [(b.line, b.language, b.runnable) for b in blocks] == [
        (2, "python", True),
        (7, "python", False),
        (10, "sh", True),
        (13, "py", True),
    ]
    assert blocks[0].code == "print('runs')\n"
    assert blocks[2].code == "echo '```'\n"


def test_a_marker_is_followed_by_a_python_block() -> None:
    """Every ``<!-- no-run -->`` in the documents sits right before a Python block: a marker
    left before prose or another language would mark nothing."""
    for path in _documents():
        lines = path.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines, start=1):
            if line.strip() != NO_RUN:
                continue
            following = next((ln.strip() for ln in lines[number:] if ln.strip()), "")
            assert following.startswith("```") and following[3:].strip() in PYTHON, (
                f"{path.name}:{number}: {NO_RUN} is not followed by a Python block"
            )
