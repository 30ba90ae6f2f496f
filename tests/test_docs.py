"""Every Python code block in the README and docs/ runs, so the docs cannot rot."""
from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def fenced(path: pathlib.Path) -> list[tuple[str, str]]:
    """The fenced code blocks of `path`, in order: (language, text)."""
    return FENCE.findall(path.read_text())


def _blocks(path: pathlib.Path) -> list[str]:
    return [text for language, text in fenced(path) if language == "python"]


@pytest.mark.parametrize("path", [p for p in DOCS if _blocks(p)], ids=lambda p: p.name)
def test_code_blocks_run(path):
    namespace: dict = {"__name__": f"docs_{path.stem}"}
    for i, block in enumerate(_blocks(path)):
        try:
            exec(compile(block, f"{path.name}[block {i}]", "exec"), namespace)
        except Exception as e:  # name the block that broke
            raise AssertionError(f"{path.name}, code block {i} failed: {e!r}\n{block}") from e


def test_docs_have_code():
    assert _blocks(ROOT / "docs" / "index.md")
