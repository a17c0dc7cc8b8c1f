"""Text helpers shared by answer grading (``rewards``) and the first-mistake judge (``first_mistake``)."""

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
