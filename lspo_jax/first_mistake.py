"""First-mistake token advantages: a teacher judge names where a failed rollout first went wrong.

An outcome reward says that a solution failed, not where. Here a teacher LLM reads each failed rollout of a
group and names its first genuine mistake (the *pitfall*): the tokens before it are a valid prefix, the
tokens from it on an invalid suffix, and the two get different token-level advantages.

Per RL step (``first_mistake_advantages``):

1. Groups whose K rollouts all pass or all fail are skipped (``fm_skipped_zero_variance``).
2. Reference (``reference``): ``"teacher"`` asks the teacher to solve each remaining problem (one batched
   ``generate`` call, answer in ``\\boxed{}``) and keeps the solutions the verifier accepts; the written
   solution after the last ``</think>`` is the reference. ``"ground_truth"`` uses the dataset's worked
   solution as it is (trusted, not verified). A group without a reference keeps its plain GRPO advantages
   (``fm_fallback_no_reference``).
3. Judging: each failed rollout of a group with a reference is split into numbered sentences ``[1] .. [n]``
   (``split_sentences``) and shown to the teacher with the problem and the reference, all in one batched
   call. The teacher ends with ``\\boxed{correct}`` or ``\\boxed{k}``, k the first sentence with a genuine,
   answer-invalidating mistake (``JUDGE_TEMPLATE``; ``parse_verdict`` reads the reply). Sentence k maps to
   the token holding its first character, p (``token_char_ends``); a mistake in sentence 1 gives p = 0.
4. Token advantages (``token_advantages``), per group g with outcome advantages A_i::

       a_it = lam * |A_i|    for a failed rollout i and response token t < p_i   (the valid prefix)
       a_it = A_i            otherwise (every token of a passing rollout; the suffix of a failed one)
       a_it <- a_it - b_g,   b_g = sum_{i in g, t} a_it / sum_{i in g} |y_i|   (mean over response tokens)

   ``lam = 0`` (the default) makes the valid prefix neutral before recentring.

Choices where the method is silent:

* A failed rollout gets p = 0 (A_i on every token, as in GRPO) and is counted by cause when it is truncated
  (not judged: an overlong rollout is invalid as a whole, ``fm_fallback_truncated``), has no sentence
  (``fm_fallback_empty``), is called correct by the judge (``fm_judge_said_correct``: doubt goes to the
  student, so the verifier's failure keeps its whole penalty), gets a reply that cannot be read
  (``fm_fallback_unparseable``) or a sentence number outside 1..n (``fm_fallback_out_of_range``), or when its
  text is not the decoding of its token ids so no sentence can be placed (``fm_fallback_token_map``).
* Only a group where some failed rollout has a non-empty valid prefix (p > 0) is recentred; every other
  group keeps its plain GRPO advantages exactly. Recentring a group that nothing reshaped would only move
  its advantages by the length imbalance of its rollouts, which is not the judge's signal.
* Passing rollouts are judged only with ``judge_correct`` (for ``fm_judge_agreement``); their advantages
  never depend on the verdict.
* The last verdict of a reply wins (judges revise themselves while reasoning); text inside
  ``<think>...</think>`` is ignored. See ``parse_verdict``.
* ``max_sentences`` folds the sentences past the limit into the last numbered one, so a long rollout still
  gets a short list of numbers (its prompt is as long as before).

The judge is any ``generate(prompt_texts) -> replies`` callable (``Judge``); ``SamplerGenerate`` and
``load_generate`` build one from a model in memory or a Hugging Face directory, sampled by the project's
JAX sampler or by an engine with ``generate_arrays`` (``VLLMSampler``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lspo_jax.text import matching_braces
from lspo_jax.train_config import FirstMistakeConfig

CORRECT, MISTAKE, UNPARSEABLE, OUT_OF_RANGE = "correct", "mistake", "unparseable", "out_of_range"
Generate = Callable[[list[str]], list[str]]
Span = tuple[int, int]  # [start, end) character offsets of one sentence


# -------------------------------------------------------------------------------------- token advantages
def token_advantages(
    outcome_adv: Any,
    correct: Any,
    pitfall: Any,
    response_mask: Any,
    group_size: int,
    judged: Any,
    *,
    lam: float = 0.0,
) -> np.ndarray:
    """``[N, L]`` float32 token advantages (the formula in the module docstring), zero off the mask.

    Args:
        outcome_adv: ``[N]`` outcome (GRPO) advantages A_i; rows grouped consecutively, K per group.
        correct: ``[N]`` bool, the verifier's verdict. A passing row's ``pitfall`` is ignored.
        pitfall: ``[N]`` int, the index p within the row's response where the invalid suffix starts; p <= 0
            (e.g. -1, no pitfall) puts A_i on every token, p past the response makes it all prefix.
        response_mask: ``[N, L]``, 1 on response tokens. The response's token j is the row's j-th masked
            column, so any layout works, e.g. ``packing.pack_samples``'s P prompt slots then the response.
        group_size: K.
        judged: ``[G]`` bool, groups to reshape and recentre. Groups that are not, and groups whose rollouts
            all pass or all fail, get A_i broadcast over their response tokens, unchanged.
        lam: prefix weight.
    """
    adv_N = np.asarray(outcome_adv, np.float64)
    correct_N = np.asarray(correct, bool)
    pitfall_N = np.asarray(pitfall, np.int64)
    mask_NL = np.asarray(response_mask) > 0
    judged_G = np.asarray(judged, bool)
    n, length = mask_NL.shape
    if group_size < 1 or n % group_size or judged_G.shape != (n // group_size,):
        raise ValueError(f"{n} rows in groups of {group_size} do not match judged of shape {judged_G.shape}")
    if not adv_N.shape == correct_N.shape == pitfall_N.shape == (n,):
        raise ValueError(f"outcome_adv, correct and pitfall must be [{n}], got {adv_N.shape}, {correct_N.shape}")
    position_NL = np.cumsum(mask_NL, axis=1) - 1
    prefix_NL = mask_NL & ~correct_N[:, None] & (position_NL < pitfall_N[:, None])
    shaped_NL = np.where(prefix_NL, lam * np.abs(adv_N)[:, None], adv_N[:, None]) * mask_NL
    plain_NL = adv_N[:, None] * mask_NL
    correct_GK = correct_N.reshape(-1, group_size)
    reshape_G = judged_G & correct_GK.any(axis=1) & ~correct_GK.all(axis=1)
    token_sum_G = shaped_NL.reshape(-1, group_size * length).sum(axis=1)
    token_count_G = mask_NL.reshape(-1, group_size * length).sum(axis=1)
    baseline_N = np.repeat(token_sum_G / np.maximum(token_count_G, 1), group_size)
    recentred_NL = (shaped_NL - baseline_N[:, None]) * mask_NL
    out_NL = np.where(np.repeat(reshape_G, group_size)[:, None], recentred_NL, plain_NL)
    return out_NL.astype(np.float32)


# --------------------------------------------------------------------------------------------- sentences
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
        upto = _batch_decode(tokenizer, [ids[s : j + 1] for j, s in enumerate(starts)])
        before = _batch_decode(tokenizer, [ids[s:j] for j, s in enumerate(starts)])
        ends = np.cumsum([len(a) - len(b) for a, b in zip(upto, before, strict=True)])
        if ends[-1] == len(_batch_decode(tokenizer, [ids])[0]):
            return ends
    return np.asarray([len(t) for t in _batch_decode(tokenizer, [ids[: j + 1] for j in range(len(ids))])])


def _batch_decode(tokenizer: Any, seqs: list[list[int]]) -> list[str]:
    if hasattr(tokenizer, "batch_decode"):  # transformers
        return list(tokenizer.batch_decode(seqs, skip_special_tokens=True))
    return list(tokenizer.decode_batch(seqs, skip_special_tokens=True))  # a bare tokenizers.Tokenizer


def sentence_token_starts(spans: Sequence[Span], ends: np.ndarray) -> list[int]:
    """Per sentence, the index of the token holding its first character (first j with ``ends[j] > start``)."""
    # A partial multi-byte character can decode longer than the whole one; the running max keeps it sorted.
    running = np.maximum.accumulate(np.asarray(ends))
    return [int(np.searchsorted(running, start, side="right")) for start, _ in spans]


# ------------------------------------------------------------------------------------------------ prompts
SOLVE_TEMPLATE = (
    "Solve the following math problem. Reason step by step, and put your final answer within \\boxed{{}}.\n\n{problem}"
)
JUDGE_TEMPLATE = (
    "You are checking a student's solution to a math problem against a reference solution that is known to be "
    "correct.\n\nProblem:\n{problem}\n\nReference solution:\n{reference}\n\n"
    "Student solution, split into numbered sentences:\n{solution}\n\n"
    "Find the FIRST sentence of the student solution that contains a genuine mistake: an error in reasoning or "
    "computation that makes the student's final answer wrong. A different but valid approach is not a mistake, "
    "nor is a slip that the student notices and corrects later, nor equivalent notation or an equivalent form "
    "of an answer. When in doubt, decide in the student's favour.\n\n"
    "End your reply with your verdict in a box: \\boxed{{correct}} if the student solution has no genuine "
    "mistake, otherwise \\boxed{{k}} where k is the number of the first sentence with a genuine mistake (an "
    "integer from 1 to {n})."
)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A judge's reading of one rollout: ``kind`` (``CORRECT``, ``MISTAKE``, ``UNPARSEABLE``, ``OUT_OF_RANGE``)
    and, for ``MISTAKE``, the 1-based ``sentence`` of the first mistake."""

    kind: str
    sentence: int | None = None


_BOX_OPEN = re.compile(r"\\boxed\s*\{")
# A labelled verdict: the label, separators or markdown, then a sentence number or a "correct" word, not
# followed by more of a word, a decimal part or an operator (``FIRST MISTAKE: 7``, ``**Verdict:** correct``;
# not ``first mistake is 2+2=5`` or ``3-5``).
_LABELLED = re.compile(
    r"(?:first\s+mistake|verdict)(?:\s+is)?[\s*$:=]*"
    r"((?:sentence|step)?\s*#?\s*[\[(]?\s*[+-]?\d+\s*[\])]?|correct|none|no\s+(?:mistakes?|errors?))(?!\w|[.,]\d|\s*[-+*/=^<>]\s*\w)",
    re.IGNORECASE,
)
_NUMBER = re.compile(r"(?:sentence|step)?\s*#?\s*[\[(]?\s*([+-]?)(\d+)\s*[\])]?")
_CORRECT_WORDS = frozenset({"correct", "none", "no mistake", "no mistakes", "no error", "no errors"})
_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mathbf)\s*\{([^{}]*)\}")
_MAX_DIGITS = 9  # no rollout has a billion sentences; longer numbers are out of range without int()


def parse_verdict(reply: str, num_sentences: int) -> Verdict:
    """The verdict of a judge's reply on a rollout of ``num_sentences`` sentences.

    Verdicts are ``\\boxed{...}`` (as ``JUDGE_TEMPLATE`` asks) or a labelled ``FIRST MISTAKE: 7`` /
    ``Verdict: correct``. The last one in the reply wins, after dropping everything up to the last
    ``</think>`` and from an unclosed ``<think>`` on. A verdict of ``correct`` (or ``none``, ``no mistake``)
    is ``CORRECT``; an integer (``7``, ``[7]``, ``sentence 7``) is ``MISTAKE`` in 1..n and ``OUT_OF_RANGE``
    otherwise (0, negative, too large); anything else in the last box, or no verdict at all, is
    ``UNPARSEABLE``. Conflicting verdicts are not an error: the judge's last word is its verdict.
    """
    text = _outside_thinking(reply or "")
    candidates = [(m.start(), m.group(1)) for m in _LABELLED.finditer(text)] + _boxes(text)
    if not candidates:
        return Verdict(UNPARSEABLE)
    content = _WRAPPERS.sub(r"\1", max(candidates)[1])
    content = re.sub(r"\s+", " ", content.strip(" \t\n$*`.'\"")).lower()
    if content in _CORRECT_WORDS:
        return Verdict(CORRECT)
    number = _NUMBER.fullmatch(content)
    if number is None:
        return Verdict(UNPARSEABLE)
    sign, digits = number.groups()
    sentence = -1 if sign == "-" or len(digits) > _MAX_DIGITS else int(digits)
    return Verdict(MISTAKE, sentence) if 1 <= sentence <= num_sentences else Verdict(OUT_OF_RANGE)


def _outside_thinking(reply: str) -> str:
    close = reply.rfind("</think>")
    if close >= 0:
        reply = reply[close + len("</think>") :]
    opened = reply.find("<think>")
    return reply if opened < 0 else reply[:opened]


def _boxes(text: str) -> list[tuple[int, str]]:
    """``(position, content)`` of every complete ``\\boxed{...}``, braces matched; an unclosed box is skipped."""
    pairs = matching_braces(text)
    opens = [(m.start(), m.end() - 1) for m in _BOX_OPEN.finditer(text)]
    return [(start, text[brace + 1 : pairs[brace]]) for start, brace in opens if brace in pairs]


def written_solution(reply: str) -> str:
    """The part of a teacher's solution shown as the reference: after the last ``</think>`` when not empty."""
    after = reply.rsplit("</think>", 1)[-1].strip()
    return after or reply.strip()


# ------------------------------------------------------------------------------------------------- judge
class Judge:
    """The teacher's two stages through one engine-agnostic ``generate(prompt_texts) -> replies`` callable.

    Each method makes at most one ``generate`` call for its whole batch. ``generate`` gets the user turns as
    text; rendering them (chat template, tokens) is its business.
    """

    def __init__(self, generate: Generate, *, solve_template: str = SOLVE_TEMPLATE, judge_template=JUDGE_TEMPLATE):
        for name, template, fields in (
            ("solve_template", solve_template, {"problem": ""}),
            ("judge_template", judge_template, {"problem": "", "reference": "", "solution": "", "n": 1}),
        ):
            try:
                template.format(**fields)
            except (KeyError, IndexError, ValueError) as err:
                raise ValueError(f"{name}: not a template over {sorted(fields)}: {err!r}") from err
        self.generate = generate
        self.solve_template, self.judge_template = solve_template, judge_template

    def solve(self, problems: Sequence[str]) -> list[str]:
        """Stage 1: the teacher's own solution of each problem."""
        return self._call([self.solve_template.format(problem=p) for p in problems])

    def locate(
        self, problems: Sequence[str], references: Sequence[str], texts: Sequence[str], spans: Sequence[list[Span]]
    ) -> list[Verdict]:
        """Stage 2: the verdict on each rollout ``texts[i]`` (sentences ``spans[i]``) of ``problems[i]``."""
        prompts = [
            self.judge_template.format(problem=p, reference=r, solution=numbered(t, s), n=len(s))
            for p, r, t, s in zip(problems, references, texts, spans, strict=True)
        ]
        replies = self._call(prompts)
        return [parse_verdict(reply, len(s)) for reply, s in zip(replies, spans, strict=True)]

    def _call(self, prompts: list[str]) -> list[str]:
        if not prompts:
            return []
        replies = list(self.generate(prompts))
        if len(replies) != len(prompts):
            raise ValueError(f"generate returned {len(replies)} replies for {len(prompts)} prompts")
        return [reply if isinstance(reply, str) else "" for reply in replies]


class SamplerGenerate:
    """``generate(prompt_texts) -> replies`` from a model in memory.

    Prompts go through ``data.render_prompt`` (the chat template when the tokenizer has one) and are sampled
    ``max_batch`` at a time by ``sampler.generate_arrays``, or by ``engine.generate_arrays(params, prompts,
    ...)`` when an engine such as ``VLLMSampler`` is given. ``temperature`` 0 decodes greedily; otherwise
    call c uses ``fold_in(key(seed), c)``. A prompt longer than ``max_prompt_tokens`` (default: the
    model's positions minus ``max_new_tokens``) is not sampled and gets an empty reply. ``params`` and ``mesh``
    are public: when the policy judges itself, assign the current params (and the mesh they are split over)
    before each step.
    """

    def __init__(
        self,
        config: Any,
        params: Any,
        tokenizer: Any,
        eos_ids: Sequence[int],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int = 0,
        max_batch: int = 64,
        max_prompt_tokens: int | None = None,
        engine: Any = None,
        mesh: Any = None,
    ):
        self.config, self.params, self.tokenizer, self.engine = config, params, tokenizer, engine
        self.mesh = mesh  # where the JAX sampler runs (None: this process's first device)
        self.eos_ids = tuple(int(t) for t in eos_ids)
        self.max_new_tokens, self.temperature, self.seed, self.max_batch = max_new_tokens, temperature, seed, max_batch
        room = config.max_position_embeddings - max_new_tokens
        self.max_prompt_tokens = max_prompt_tokens if max_prompt_tokens is not None else max(room, 1)
        self.calls = 0

    def __call__(self, prompt_texts: list[str]) -> list[str]:
        from lspo_jax.data import render_prompt

        prompts = [render_prompt(self.tokenizer, text) for text in prompt_texts]
        fits = [i for i, p in enumerate(prompts) if 0 < len(p) <= self.max_prompt_tokens]
        replies = [""] * len(prompts)
        for first in range(0, len(fits), self.max_batch):
            rows = fits[first : first + self.max_batch]
            for i, reply in zip(rows, self._sample([prompts[i] for i in rows]), strict=True):
                replies[i] = reply
        return replies

    def _sample(self, prompts: list[list[int]]) -> list[str]:
        import jax

        from lspo_jax import sampler

        key = jax.random.fold_in(jax.random.key(self.seed), self.calls)
        self.calls += 1
        greedy = self.temperature == 0
        options = dict(
            key=key, max_new_tokens=self.max_new_tokens, temperature=1.0 if greedy else self.temperature,
            eos_token_ids=self.eos_ids, n=1, greedy=greedy,
        )  # fmt: skip
        if self.engine is not None:
            batch = self.engine.generate_arrays(self.params, prompts, **options)
        else:
            batch = sampler.generate_arrays(self.config, self.params, prompts, mesh=self.mesh, **options)
        return [
            self.tokenizer.decode(tokens[: int(length)], skip_special_tokens=True)
            for tokens, length in zip(batch.tokens, batch.lengths, strict=True)
        ]


def load_generate(path: str, *, dtype: str = "float32", engine: Any = None, **options: Any) -> SamplerGenerate:
    """A ``SamplerGenerate`` on the Hugging Face directory ``path`` (weights and compute in ``dtype``);
    ``options`` are ``SamplerGenerate``'s keywords (``max_new_tokens``, ``temperature``, ``seed``, ...)."""
    from lspo_jax import hf

    config, params = hf.load_pretrained(path, dtype=dtype)
    config = dataclasses.replace(config, compute_dtype=dtype)
    tokenizer = hf.load_tokenizer(path)
    eos = config.eos_token_id if config.eos_token_id is not None else tokenizer.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, tuple | list) else (int(eos),)
    return SamplerGenerate(config, params, tokenizer, eos_ids, engine=engine, **options)


def make_judge(config: FirstMistakeConfig, *, policy: Any = None, params: Any = None, engine: Any = None) -> Judge:
    """The judge of ``config``: a model loaded from ``judge_path``, or the policy (``policy.config``,
    ``.tokenizer``, ``.eos_ids``) with ``params`` when ``judge_path`` is None."""
    options = dict(
        max_new_tokens=config.max_new_tokens, temperature=config.teacher_temperature, seed=config.seed,
        max_batch=config.max_batch, engine=engine,
    )  # fmt: skip
    if config.judge_path is not None:
        return Judge(load_generate(config.judge_path, **options))
    if policy is None or params is None:
        raise ValueError("judge_path is null, so the policy judges itself: pass policy and params")
    return Judge(SamplerGenerate(policy.config, params, policy.tokenizer, policy.eos_ids, **options))


# ------------------------------------------------------------------------------------------------ a step
Score = Callable[[list[str], list[str]], Sequence[float]]


def first_mistake_advantages(
    *,
    problems: Sequence[str],
    golds: Sequence[str],
    references: Sequence[str | None] | None,
    response_texts: Sequence[str],
    response_ids: Sequence[Sequence[int]],
    response_mask: Any,
    truncated: Any,
    accuracy: Any,
    outcome_adv: Any,
    group_size: int,
    score: Score,
    judge: Judge,
    tokenizer: Any,
    config: FirstMistakeConfig,
    valid: Any = None,
) -> tuple[np.ndarray, dict[str, Any]]:
    """``([N, L] token advantages, metrics)`` of one RL batch of G groups of K rollouts (module docstring).

    ``valid`` (``[N]`` bool, optional) marks the rows of groups smaller than K (the rest is padding with no
    tokens): a group is mixed, and a row judged, on its valid rows alone.

    Per group: ``problems``, ``golds`` and ``references`` (the dataset's worked solutions, needed for
    ``reference="ground_truth"``). Per row: the verifier's ``response_texts``, the ``response_ids`` they
    decode from (``response_mask[i]`` has ``len(response_ids[i])`` ones), ``truncated`` (ended without EOS),
    ``accuracy`` (0/1) and ``outcome_adv``. ``score(texts, golds)`` is the verifier, run on the teacher's
    solutions. One ``generate`` call per stage. Metrics (counts unless named a rate or mean):
    ``fm_groups``, ``fm_skipped_zero_variance``, ``fm_fallback_no_reference`` (groups),
    ``fm_teacher_solve_rate``, ``fm_groups_judged`` (groups with a rollout sent to the judge),
    ``fm_groups_reshaped`` (recentred), ``fm_rollouts_judged``, ``fm_pitfalls``, ``fm_judge_said_correct``,
    ``fm_fallback_{truncated, empty, unparseable, out_of_range, token_map}`` (failed rollouts),
    ``fm_judge_agreement`` (judged rollouts with a verdict whose correct/mistake matches the verifier) and
    ``fm_pitfall_rel_pos_mean`` (pitfall token / response length); rates and means are None when empty.
    """
    correct_N = np.asarray(accuracy, np.float64) > 0.5
    n, k = len(correct_N), group_size
    _check_batch(problems, golds, references, response_texts, response_ids, response_mask, n, k)
    valid_N = np.ones(n, bool) if valid is None else np.asarray(valid, bool)
    correct_GK, valid_GK = correct_N.reshape(-1, k), valid_N.reshape(-1, k)
    mixed_G = (correct_GK & valid_GK).any(axis=1) & (~correct_GK & valid_GK).any(axis=1)
    metrics: dict[str, Any] = {"fm_groups": len(mixed_G), "fm_skipped_zero_variance": int((~mixed_G).sum())}
    refs = _references(np.flatnonzero(mixed_G), problems, golds, references, score, judge, config, metrics)
    tally = _Tally()
    rows = [i for i in range(n) if i // k in refs and valid_N[i]]
    asked, spans = _to_judge(rows, response_texts, np.asarray(truncated, bool), correct_N, config, tally)
    verdicts = judge.locate(
        [problems[i // k] for i in asked], [refs[i // k] for i in asked], [response_texts[i] for i in asked], spans
    )
    pitfall_N = np.full(n, -1, np.int64)
    for i, split, verdict in zip(asked, spans, verdicts, strict=True):
        pitfall_N[i] = tally.read(verdict, bool(correct_N[i]), response_texts[i], response_ids[i], split, tokenizer)
    judged_G = np.zeros(len(mixed_G), bool)
    judged_G[np.flatnonzero(pitfall_N > 0) // k] = True
    metrics.update(tally.metrics(), fm_groups_judged=len({i // k for i in asked}), fm_rollouts_judged=len(asked))
    metrics["fm_groups_reshaped"] = int(judged_G.sum())
    adv = token_advantages(outcome_adv, correct_N, pitfall_N, response_mask, k, judged_G, lam=config.lam)
    return adv, metrics


def _check_batch(problems, golds, references, texts, ids, mask, n: int, k: int) -> None:
    if k < 1 or n % k or len(problems) != n // k or len(golds) != n // k:
        raise ValueError(f"{n} rows in groups of {k} need {n // max(k, 1)} problems and golds")
    if references is not None and len(references) != n // k:
        raise ValueError(f"references: {len(references)} for {n // k} groups")
    lengths = np.asarray(mask).astype(bool).sum(axis=1)
    if len(texts) != n or len(ids) != n or lengths.shape != (n,):
        raise ValueError(f"response_texts, response_ids and response_mask must have {n} rows")
    wrong = [i for i in range(n) if len(ids[i]) != lengths[i]]
    if wrong:
        raise ValueError(f"row {wrong[0]}: {len(ids[wrong[0]])} response ids but {lengths[wrong[0]]} mask tokens")


def _references(groups, problems, golds, references, score, judge, config, metrics) -> dict[int, str]:
    """Group -> reference solution, for the groups that have a verified one (stage 1 when ``teacher``)."""
    refs: dict[int, str] = {}
    if config.reference == "ground_truth":
        for g in groups:
            text = references[g] if references is not None else None
            if text is not None and text.strip():
                refs[int(g)] = text
        metrics["fm_teacher_solve_rate"] = None
    else:
        solutions = judge.solve([problems[g] for g in groups])
        passed = list(score(solutions, [golds[g] for g in groups])) if solutions else []
        for g, solution, ok in zip(groups, solutions, passed, strict=True):
            if ok > 0.5:
                refs[int(g)] = written_solution(solution)
        metrics["fm_teacher_solve_rate"] = len(refs) / len(groups) if len(groups) else None
    metrics["fm_fallback_no_reference"] = len(groups) - len(refs)
    return refs


def _to_judge(rows, texts, truncated_N, correct_N, config, tally) -> tuple[list[int], list[list[Span]]]:
    """The rows to show the judge and their sentences; failed rows that are truncated or empty are counted."""
    asked, spans = [], []
    for i in rows:
        if correct_N[i] and not config.judge_correct:
            continue
        if not correct_N[i] and truncated_N[i]:
            tally.fallback["truncated"] += 1
            continue
        split = split_sentences(texts[i], config.max_sentences, config.sentence_breaks)
        if not split:
            tally.fallback["empty"] += int(not correct_N[i])
            continue
        asked.append(i)
        spans.append(split)
    return asked, spans


@dataclasses.dataclass
class _Tally:
    """What the judge's verdicts did in one batch."""

    fallback: dict[str, int] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(("truncated", "empty", UNPARSEABLE, OUT_OF_RANGE, "token_map"), 0)
    )
    said_correct: int = 0
    agree: list[bool] = dataclasses.field(default_factory=list)
    rel_positions: list[float] = dataclasses.field(default_factory=list)

    def read(self, verdict: Verdict, correct: bool, text: str, ids: Sequence[int], spans, tokenizer) -> int:
        """The row's pitfall token (-1: none) from its verdict, counted."""
        if verdict.kind in (CORRECT, MISTAKE):
            self.agree.append((verdict.kind == CORRECT) == correct)
        if correct:
            return -1
        if verdict.kind == CORRECT:  # nothing to locate: the verifier's penalty stays on every token
            self.said_correct += 1
            return -1
        if verdict.kind != MISTAKE:
            self.fallback[verdict.kind] += 1
            return -1
        p = _pitfall_token(text, ids, spans, verdict.sentence, tokenizer)
        if p is None:
            self.fallback["token_map"] += 1
            return -1
        self.rel_positions.append(p / max(len(ids), 1))
        return p

    def metrics(self) -> dict[str, Any]:
        return {
            "fm_pitfalls": len(self.rel_positions),
            "fm_judge_said_correct": self.said_correct,
            "fm_judge_agreement": float(np.mean(self.agree)) if self.agree else None,
            "fm_pitfall_rel_pos_mean": float(np.mean(self.rel_positions)) if self.rel_positions else None,
            **{f"fm_fallback_{name}": count for name, count in self.fallback.items()},
        }


def _pitfall_token(text: str, ids: Sequence[int], spans: list[Span], sentence: int, tokenizer: Any) -> int | None:
    """The token where sentence ``sentence`` starts (0 for the first), or None when ``text`` is not the
    decoding of ``ids`` (no sentence can be placed)."""
    if sentence == 1:
        return 0
    if _batch_decode(tokenizer, [[int(t) for t in ids]])[0] != text:
        return None
    return sentence_token_starts([spans[sentence - 1]], token_char_ends(tokenizer, ids))[0]
