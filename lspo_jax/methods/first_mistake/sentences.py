"""A response as sentences: where each starts and ends in its text, and at which of its tokens.

The first-mistake judge (``teacher``) reads a failed rollout as numbered sentences ``[1] .. [n]``
(``split_sentences``, ``numbered``); the sentence it names maps back to the token that holds its first
character (``token_char_ends``, ``sentence_token_starts``), where the rollout's invalid suffix begins.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from lspo_jax.tasks.text import matching_braces

Span = tuple[int, int]  # [start, end) character offsets of one sentence


# Never split inside display or inline math, LaTeX environments or a matched brace group (``\boxed{..}``).
_MATH = re.compile(
    r"\$\$.*?\$\$|\\\[.*?\\\]|\\\(.*?\\\)|\\begin\{([^{}]+)\}.*?\\end\{\1\}|\$[^$\n]+\$",
    re.DOTALL,
)
# A run of newlines always ends a sentence; ., ? or ! ends one when whitespace or the end follows.
_BREAK = re.compile(r"\n+|[.?!]+(?=\s|$)")
_ABBREVIATIONS = frozenset({"e.g", "i.e", "etc", "vs", "cf", "eq", "eqs", "fig", "approx", "resp"})
_LIST_MARKER = re.compile(r"\(?(?:\d{1,3}|[a-zA-Z]|[ivx]+)\)?")


def split_sentences(text: str, max_sentences: int | None = None, extra_breaks: str = "") -> list[Span]:
    """``[start, end)`` spans of the sentences of ``text``, stripped of surrounding whitespace, in order.

    A sentence ends at a newline, or at ``.``, ``?`` or ``!`` followed by whitespace (so ``3.5`` does not
    end one), except after an abbreviation (``e.g.``) or a list marker (``1.``, ``(a).``). Nothing inside
    ``$..$``, ``$$..$$``, ``\\[..\\]``, ``\\(..\\)``, ``\\begin{env}..\\end{env}`` or a matched ``{..}``
    is a boundary. Each character of ``extra_breaks`` (e.g. ``;`` for a task that chains its steps that way)
    also ends a sentence wherever it stands. Past ``max_sentences``, the rest of the text joins the last one.
    """
    protected = _protected(text)
    spans, start = [], 0
    breaks = _BREAK if not extra_breaks else re.compile(f"{_BREAK.pattern}|[{re.escape(extra_breaks)}]")
    for match in breaks.finditer(text):
        if protected[match.start()] or _not_an_end(text, start, match):
            continue
        end = match.start() if match.group()[0] == "\n" else match.end()
        spans.append(_stripped(text, start, end))
        start = match.end()
    spans.append(_stripped(text, start, len(text)))
    spans = [s for s in spans if s[1] > s[0]]
    if max_sentences is not None and len(spans) > max_sentences:
        spans = spans[: max_sentences - 1] + [(spans[max_sentences - 1][0], spans[-1][1])]
    return spans


def _protected(text: str) -> np.ndarray:
    """Per character: True inside a math region or a matched brace group."""
    protected = np.zeros(len(text) + 1, bool)
    for match in _MATH.finditer(text):
        protected[match.start() : match.end()] = True
    for opened, closed in matching_braces(text).items():
        protected[opened : closed + 1] = True
    return protected


def _not_an_end(text: str, start: int, match: re.Match) -> bool:
    if match.group() != ".":
        return False
    before = text[start : match.start()].strip()
    last_word = before.rsplit(maxsplit=1)[-1].lower() if before else ""
    return last_word in _ABBREVIATIONS or _LIST_MARKER.fullmatch(before) is not None


def _stripped(text: str, start: int, end: int) -> Span:
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return start, end


def numbered(text: str, spans: Sequence[Span]) -> str:
    """The sentences as the judge sees them, one per line: ``[1] ...``, ``[2] ...``."""
    return "\n".join(f"[{i}] {text[start:end]}" for i, (start, end) in enumerate(spans, 1))


def token_char_ends(tokenizer: Any, token_ids: Sequence[int], *, window: int | None = 8) -> np.ndarray:
    """``ends[j] = len(decode(ids[: j + 1]))``: the character offset where token j's text ends.

    Decoded without special tokens, as the verifier's texts are. With ``window``, token j's length is
    ``len(decode(ids[s : j + 1])) - len(decode(ids[s : j]))`` with ``s = j - window``, two batched decodes of
    short slices: linear in the length, where decoding every prefix is quadratic. The slice keeps the context
    that decoders look at (a word's leading space, a multi-byte character split over tokens); when the total
    still disagrees with the full decoding, every prefix is decoded instead (``window=None`` always does).
    """
    ids = [int(t) for t in token_ids]
    if not ids:
        return np.zeros(0, np.int64)
    if window is not None:
        starts = [max(0, j - window) for j in range(len(ids))]
        upto = batch_decode(tokenizer, [ids[s : j + 1] for j, s in enumerate(starts)])
        before = batch_decode(tokenizer, [ids[s:j] for j, s in enumerate(starts)])
        ends = np.cumsum([len(a) - len(b) for a, b in zip(upto, before, strict=True)])
        if ends[-1] == len(batch_decode(tokenizer, [ids])[0]):
            return ends
    return np.asarray([len(t) for t in batch_decode(tokenizer, [ids[: j + 1] for j in range(len(ids))])])


def batch_decode(tokenizer: Any, seqs: list[list[int]]) -> list[str]:
    if hasattr(tokenizer, "batch_decode"):  # transformers
        return list(tokenizer.batch_decode(seqs, skip_special_tokens=True))
    return list(tokenizer.decode_batch(seqs, skip_special_tokens=True))  # a bare tokenizers.Tokenizer


def sentence_token_starts(spans: Sequence[Span], ends: np.ndarray) -> list[int]:
    """Per sentence, the index of the token holding its first character (first j with ``ends[j] > start``)."""
    # A partial multi-byte character can decode longer than the whole one; the running max keeps it sorted.
    running = np.maximum.accumulate(np.asarray(ends))
    return [int(np.searchsorted(running, start, side="right")) for start, _ in spans]
