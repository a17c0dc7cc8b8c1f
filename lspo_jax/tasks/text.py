"""Text helpers shared by answer grading (``rewards``), the first-mistake judge (``first_mistake``) and the
one-line errors of data files and checkpoints."""

from __future__ import annotations

import re


def matching_braces(text: str) -> dict[int, int]:
    """Position of each ``{`` -> position of its ``}``, in one pass (unclosed braces are absent)."""
    pairs: dict[int, int] = {}
    stack: list[int] = []
    for brace in re.finditer(r"[{}]", text):
        if brace.group() == "{":
            stack.append(brace.start())
        elif stack:
            pairs[stack.pop()] = brace.start()
    return pairs


def error_cause(err: BaseException, limit: int = 160) -> str:
    """``Type: the first line of its message``, cut to ``limit`` characters, for a one-line error (tensorstore
    and pyarrow append pages of details after the first line or sentence)."""
    lines = str(err).strip().splitlines()
    text = lines[0].split(". See ")[0][:limit] if lines else ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
