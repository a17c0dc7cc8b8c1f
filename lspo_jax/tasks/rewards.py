"""Rewards: math-verify accuracy, gold-answer parsing, DAPO's overlong penalty and the shaped reward.

Accuracy (0/1 from the verifier) and the shaped reward (accuracy + overlong penalty) are kept apart on
purpose: cliffs are defined on accuracy, while advantages are computed from the shaped reward.

``math_reward`` runs math-verify in the calling process with math-verify's own timeouts disabled (they use
``signal.alarm``, which only works on the main thread). A pathological answer such as
``\\boxed{9^{9^{9^{9}}}}`` against a number then keeps it busy for over a minute. For training, score batches with
``verify_pool.VerifierPool``, which runs the same
``score_response`` in worker processes and kills a worker that overruns its per-item timeout.

math-verify is imported at the first parse, not with this module: the trainer, the sampler and the benchmarks
import this module for the length shaping alone and run where math-verify is not installed.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from sympy import Basic, MatrixBase

from lspo_jax.tasks.text import matching_braces

__all__ = [
    "GoldReport",
    "ShapedRewards",
    "answer_text",
    "last_boxed",
    "math_reward",
    "overlong_penalty",
    "parse_gold",
    "parse_golds",
    "parse_response",
    "score_response",
    "shaped_rewards",
]

THINK_CLOSE = "</think>"


class _MathVerify(NamedTuple):
    parse: Any
    verify: Any
    timeout_error: type[BaseException]  # math-verify's TimeoutException derives from BaseException
    response_config: tuple
    gold_config: tuple


@functools.cache
def _math_verify() -> _MathVerify:
    """math-verify and this module's extraction settings, imported once, at first use."""
    try:
        import math_verify
        from math_verify.errors import TimeoutException
    except ImportError as exc:
        raise ImportError("scoring answers needs math-verify: pip install 'math-verify>=0.8,<0.10'") from exc
    latex, expr = math_verify.LatexExtractionConfig, math_verify.ExprExtractionConfig
    # Boxed answers first. Responses with a box are reduced to their last box before parsing (see
    # parse_response); without one, math-verify falls back to its usual anchors ("final answer is",
    # "answer:", plain LaTeX, then bare numbers and expressions).
    return _MathVerify(
        parse=math_verify.parse,
        verify=math_verify.verify,
        timeout_error=TimeoutException,
        response_config=(latex(boxed_match_priority=0), expr()),
        gold_config=(latex(), expr()),
    )


# A "$" not preceded by a backslash opens inline math; "\$" is a dollar sign (MATH500 has "\$36").
_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")


class _DropDisabledTimeoutWarning(logging.Filter):
    """math-verify warns once per process that its timeout is off; here that is deliberate."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


# Filters act on records logged to the logger itself, so attach to the two modules that log it.
for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropDisabledTimeoutWarning())


# ------------------------------------------------------------------------------------------------ parsing
def _is_math(obj: Any) -> bool:
    """True for a sympy result; math-verify's string fallbacks (unparsed text) are not."""
    return isinstance(obj, (Basic, MatrixBase))


def _gold_candidates(gold: str) -> list[str]:
    """Ways of writing a gold answer that math-verify's extractor recognises, most specific first.

    A bare ``\\sqrt{2}`` or ``x^2+1`` is not extracted at all without math delimiters, so plain answers are
    tried inside ``\\boxed{}`` and ``$...$`` before the raw text.
    """
    if "\\boxed" in gold or _UNESCAPED_DOLLAR.search(gold):
        return [gold]
    return [f"\\boxed{{{gold}}}", f"${gold}$", gold]


def parse_gold(gold: str) -> list | None:
    """Parse a gold answer string with math-verify; ``None`` when no candidate yields a sympy object.

    The result is math-verify's list (sympy object first, then its normalised string), ready for
    ``verify``. Sympy results pickle, but ``VerifierPool`` ships gold *strings* and re-parses them in the
    workers through a cache, which keeps messages small and avoids pickling edge cases of sympy objects.
    """
    gold = str(gold).strip()
    if not gold:
        return None
    mv = _math_verify()
    for text in _gold_candidates(gold):
        result = mv.parse(text, extraction_config=mv.gold_config, parsing_timeout=None)
        if any(_is_math(x) for x in result):
            return result
    return None


@functools.lru_cache(maxsize=16384)
def _parse_gold_cached(gold: str) -> tuple | None:
    """Golds repeat K times per step (once per rollout); parse each distinct one once per process."""
    result = parse_gold(gold)
    return None if result is None else tuple(result)


def answer_text(response: str, *, require_think_close: bool = False) -> str | None:
    """The part of a response that is graded, or ``None`` when nothing may be graded.

    With ``require_think_close`` only the text after the last ``</think>`` counts, and a response without
    one (cut off mid-thought) gets ``None``: math-verify would otherwise find a bare number anywhere in
    the reasoning ("so 2+2=4, hmm") and could score an unfinished response as correct.
    """
    if not require_think_close:
        return response
    cut = response.rfind(THINK_CLOSE)
    return None if cut < 0 else response[cut + len(THINK_CLOSE) :]


_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces matched.

    A box left open by truncation is skipped, since it holds no finished answer.
    """
    opens = [m.end() - 1 for m in _BOX_OPEN.finditer(text)]  # positions of the boxes' "{"
    if not opens:
        return None
    pairs = matching_braces(text)
    for start in reversed(opens):
        if start in pairs:
            return text[start + 1 : pairs[start]]
    return None


def parse_response(text: str) -> list:
    """Extract and parse the answer of a response: the last complete ``\\boxed{}`` alone when there is one,
    else math-verify's usual extraction over the whole text.

    Isolating the last box matters: math-verify itself merges boxes that are close together (``\\boxed{3}.
    So \\boxed{4}`` becomes the set {3, 4}), whereas a response's final boxed answer is what it commits to.
    """
    boxed = last_boxed(text)
    if boxed is not None:
        text = f"\\boxed{{{boxed}}}"
    mv = _math_verify()
    return mv.parse(text, extraction_config=mv.response_config, parsing_timeout=None)


# ------------------------------------------------------------------------------------------------ scoring
def score_response(response: str, gold: str, *, require_think_close: bool = False) -> float:
    """1.0 if ``response`` answers ``gold`` per math-verify, else 0.0; no timeout, exceptions propagate.

    This is the unit of work of ``VerifierPool``'s workers, which count what it raises as errors. An
    unparseable gold scores 0 (``parse_golds`` is where those are reported).
    """
    text = answer_text(response, require_think_close=require_think_close)
    gold_parsed = _parse_gold_cached(str(gold).strip())
    if text is None or gold_parsed is None:
        return 0.0
    predicted = parse_response(text)
    if not predicted:
        return 0.0
    # verify() treats anything but a list as a single expression, so the cached tuple goes back to a list.
    return 1.0 if _math_verify().verify(list(gold_parsed), predicted, timeout_seconds=None) else 0.0


def math_reward(response: str, gold: str, *, require_think_close: bool = False) -> float:
    """Accuracy of one response against one gold answer: 1.0 or 0.0, never an exception.

    Prefers the last ``\\boxed{}`` answer, falling back to math-verify's normal extraction. Runs in this
    process without a timeout; use ``VerifierPool`` for untrusted model output in bulk.
    """
    timeout_error = _math_verify().timeout_error  # outside the try: a missing math-verify is not a 0
    try:
        return score_response(response, gold, require_think_close=require_think_close)
    except (Exception, timeout_error):
        return 0.0


# ------------------------------------------------------------------------------------------- gold report
@dataclass(frozen=True)
class GoldReport:
    """Gold answers parsed up front. An unparseable gold would make a permanent fake cliff (no rollout can
    ever match it), so those are listed here to be fixed or excluded before training.

    Attributes:
        parsed: id -> math-verify parse result, for the golds that parsed.
        bad: id -> raw gold string, for the golds that did not.
    """

    parsed: dict[Hashable, list]
    bad: dict[Hashable, str]

    @property
    def bad_ids(self) -> list:
        return list(self.bad)

    @property
    def ok_ids(self) -> list:
        return list(self.parsed)

    @property
    def n_bad(self) -> int:
        return len(self.bad)

    @property
    def total(self) -> int:
        return len(self.parsed) + len(self.bad)

    def summary(self, max_listed: int = 10) -> str:
        """One line for logs: counts and the first few bad ids with their gold text."""
        shown = ", ".join(f"{k!r}: {v!r}" for k, v in list(self.bad.items())[:max_listed])
        more = f" (+{self.n_bad - max_listed} more)" if self.n_bad > max_listed else ""
        return f"golds: {self.total} total, {self.n_bad} unparseable" + (f": {{{shown}}}{more}" if shown else "")


def parse_golds(items: Mapping[Hashable, str] | Iterable[tuple[Hashable, str]]) -> GoldReport:
    """Parse every gold answer once; ``items`` is a mapping id -> gold or an iterable of (id, gold) pairs."""
    pairs = items.items() if isinstance(items, Mapping) else items
    parsed: dict[Hashable, list] = {}
    bad: dict[Hashable, str] = {}
    timeout_error = _math_verify().timeout_error
    for item_id, gold in pairs:
        try:
            result = parse_gold(gold)
        except (Exception, timeout_error):
            result = None
        if result is None:
            bad[item_id] = gold
        else:
            parsed[item_id] = result
    return GoldReport(parsed=parsed, bad=bad)


# --------------------------------------------------------------------------------------- length shaping
def _array_module(x: Any):
    """jax.numpy for JAX arrays, numpy otherwise; jax is imported only when a JAX array is passed."""
    if type(x).__module__.startswith(("jax", "jaxlib")):
        import jax.numpy as jnp

        return jnp
    return np


def overlong_penalty(lengths: Any, max_len: int, buffer: int, factor: float = 1.0) -> Any:
    """DAPO's soft overlong penalty ``min(0, -(L - (max_len - buffer)) / buffer) * factor``.

    ``lengths`` are response lengths in tokens, EOS included. The penalty is 0 up to
    ``max_len - buffer`` tokens and falls linearly to ``-factor`` at ``max_len``. As in DAPO it is not
    clipped: a length past ``max_len`` (which a sampler capped at ``max_len`` cannot produce) keeps
    falling linearly below ``-factor``. Returns a float32 array (numpy in, numpy out; JAX in, JAX out).
    """
    if buffer <= 0 or buffer > max_len:
        raise ValueError(f"need 0 < buffer <= max_len, got buffer={buffer}, max_len={max_len}")
    xp = _array_module(lengths)
    lengths = xp.asarray(lengths, dtype=xp.float32)
    start = max_len - buffer
    return xp.minimum(0.0, -(lengths - start) / buffer) * xp.float32(factor)


class ShapedRewards(NamedTuple):
    """``accuracy``: verifier 0/1 (defines cliffs); ``reward``: accuracy + overlong penalty (for advantages)."""

    accuracy: Any
    reward: Any


def shaped_rewards(accuracy: Any, lengths: Any, *, max_len: int, buffer: int, factor: float = 1.0) -> ShapedRewards:
    """Add the overlong penalty to the accuracy of every rollout, passing or not, as DAPO does."""
    xp = _array_module(accuracy)
    accuracy = xp.asarray(accuracy, dtype=xp.float32)
    penalty = overlong_penalty(lengths, max_len, buffer, factor)
    if accuracy.shape != penalty.shape:
        raise ValueError(f"accuracy shape {accuracy.shape} != lengths shape {penalty.shape}")
    return ShapedRewards(accuracy=accuracy, reward=accuracy + penalty)
