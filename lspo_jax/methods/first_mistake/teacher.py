"""The first-mistake teacher: its two prompts, the reading of its replies, and the ``generate`` it calls.

``Judge`` makes the teacher's two stages (solve a problem; name the first wrong sentence of a rollout) batched calls
(``max_batch`` prompts each) through any ``generate(prompt_texts) -> replies``: ``SamplerGenerate`` over a model in
memory, or a script. ``parse_verdict`` reads a reply's ``\\boxed{correct}`` or ``\\boxed{k}``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

from lspo_jax.methods.first_mistake.config import FirstMistakeConfig
from lspo_jax.methods.first_mistake.sentences import Span, numbered
from lspo_jax.tasks.text import matching_braces

CORRECT, MISTAKE, UNPARSEABLE, OUT_OF_RANGE = "correct", "mistake", "unparseable", "out_of_range"
Generate = Callable[[list[str]], list[str]]
Check = Callable[[], None]  # called between two of the teacher's batches; raises to end the stage there


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

    Each method calls ``generate`` once per ``max_batch`` prompts (None: once for its whole batch), and between two
    calls its ``check``, which may raise to end the stage there (a stop asked for: ``phases.Phases.within``): a
    teacher's batch is the piece a stop waits for, not the whole stage. ``generate`` gets the user turns as text;
    rendering them (chat template, tokens) is its business.
    """

    def __init__(
        self, generate: Generate, *, solve_template: str = SOLVE_TEMPLATE, judge_template=JUDGE_TEMPLATE,
        max_batch: int | None = None,
    ):  # fmt: skip
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch: {max_batch}, not a positive number of prompts")
        for name, template, fields in (
            ("solve_template", solve_template, {"problem": ""}),
            ("judge_template", judge_template, {"problem": "", "reference": "", "solution": "", "n": 1}),
        ):
            try:
                template.format(**fields)
            except (KeyError, IndexError, ValueError) as err:
                raise ValueError(f"{name}: not a template over {sorted(fields)}: {err!r}") from err
        self.generate, self.max_batch = generate, max_batch
        self.solve_template, self.judge_template = solve_template, judge_template

    def solve(self, problems: Sequence[str], check: Check | None = None) -> list[str]:
        """Stage 1: the teacher's own solution of each problem."""
        return self._call([self.solve_template.format(problem=p) for p in problems], check)

    def locate(
        self, problems: Sequence[str], references: Sequence[str], texts: Sequence[str], spans: Sequence[list[Span]],
        check: Check | None = None,
    ) -> list[Verdict]:  # fmt: skip
        """Stage 2: the verdict on each rollout ``texts[i]`` (sentences ``spans[i]``) of ``problems[i]``."""
        prompts = [
            self.judge_template.format(problem=p, reference=r, solution=numbered(t, s), n=len(s))
            for p, r, t, s in zip(problems, references, texts, spans, strict=True)
        ]
        replies = self._call(prompts, check)
        return [parse_verdict(reply, len(s)) for reply, s in zip(replies, spans, strict=True)]

    def _call(self, prompts: list[str], check: Check | None = None) -> list[str]:
        replies: list[str] = []
        size = self.max_batch or max(len(prompts), 1)
        for first in range(0, len(prompts), size):
            if check is not None and first:
                check()
            batch = prompts[first : first + size]
            got = list(self.generate(batch))
            if len(got) != len(batch):
                raise ValueError(f"generate returned {len(got)} replies for {len(batch)} prompts")
            replies.extend(reply if isinstance(reply, str) else "" for reply in got)
        return replies


class SamplerGenerate:
    """``generate(prompt_texts) -> replies`` from a model in memory.

    Prompts go through ``templates.render_prompt`` (the chat template when the tokenizer has one) and are sampled
    ``max_batch`` at a time by ``sampler.generate_arrays``, or by ``engine.generate_arrays(params, prompts,
    ...)`` when an engine such as ``VLLMSampler`` is given. ``temperature`` 0 decodes greedily; otherwise
    call c uses ``fold_in(key(seed), c)``. A prompt longer than ``max_prompt_tokens`` (default: the
    model's positions minus ``max_new_tokens``) is not sampled and gets an empty reply. ``params`` is the
    weights, or a function returning them at each call: the policy judging itself reads its current base that
    way (``make_judge``), and nothing writes into the judge between steps. ``mesh``: where the JAX sampler runs.
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
        from lspo_jax.tasks.templates import render_prompt

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

        from lspo_jax.rollout import sampler

        key = jax.random.fold_in(jax.random.key(self.seed), self.calls)
        self.calls += 1
        greedy = self.temperature == 0
        options = dict(
            key=key, max_new_tokens=self.max_new_tokens, temperature=1.0 if greedy else self.temperature,
            eos_token_ids=self.eos_ids, n=1, greedy=greedy,
        )  # fmt: skip
        params = self.params() if callable(self.params) else self.params
        if self.engine is not None:
            batch = self.engine.generate_arrays(params, prompts, **options)
        else:
            batch = sampler.generate_arrays(self.config, params, prompts, mesh=self.mesh, **options)
        return [
            self.tokenizer.decode(tokens[: int(length)], skip_special_tokens=True)
            for tokens, length in zip(batch.tokens, batch.lengths, strict=True)
        ]


def load_generate(path: str, *, dtype: str = "float32", engine: Any = None, **options: Any) -> SamplerGenerate:
    """A ``SamplerGenerate`` on the Hugging Face directory ``path`` (weights and compute in ``dtype``);
    ``options`` are ``SamplerGenerate``'s keywords (``max_new_tokens``, ``temperature``, ``seed``, ...)."""
    from lspo_jax.models import hf

    config, params = hf.load_pretrained(path, dtype=dtype)
    config = dataclasses.replace(config, compute_dtype=dtype)
    tokenizer = hf.load_tokenizer(path)
    eos = config.eos_token_id if config.eos_token_id is not None else tokenizer.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, tuple | list) else (int(eos),)
    return SamplerGenerate(config, params, tokenizer, eos_ids, engine=engine, **options)


def make_judge(
    config: FirstMistakeConfig, *, policy: Any = None, params: Any = None, engine: Any = None, mesh: Any = None
) -> Judge:
    """The judge of ``config``: a model loaded from ``judge_path``, or the policy (``policy.config``,
    ``.tokenizer``, ``.eos_ids``) with ``params`` (its weights, or a function returning its current ones) on
    ``mesh`` when ``judge_path`` is None."""
    options = dict(
        max_new_tokens=config.max_new_tokens, temperature=config.teacher_temperature, seed=config.seed,
        max_batch=config.max_batch, engine=engine,
    )  # fmt: skip
    if config.judge_path is not None:
        return Judge(load_generate(config.judge_path, **options), max_batch=config.max_batch)
    if policy is None or params is None:
        raise ValueError("judge_path is null, so the policy judges itself: pass policy and params")
    generate = SamplerGenerate(policy.config, params, policy.tokenizer, policy.eos_ids, mesh=mesh, **options)
    return Judge(generate, max_batch=config.max_batch)
