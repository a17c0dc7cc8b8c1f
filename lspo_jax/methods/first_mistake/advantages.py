"""First-mistake token advantages: a teacher judge names where a failed rollout first went wrong.

An outcome reward says that a solution failed, not where. Here a teacher LLM reads each failed rollout of a
group and names its first genuine mistake (the *pitfall*): the tokens before it are a valid prefix, the
tokens from it on an invalid suffix, and the two get different token-level advantages.

Per RL step (``first_mistake_advantages``):

1. Groups whose K rollouts all pass or all fail are skipped (``fm_skipped_zero_variance``).
2. Reference (``reference``): ``"teacher"`` asks the teacher to solve each remaining problem (batched
   ``generate`` calls, answer in ``\\boxed{}``) and keeps the solutions the verifier accepts; the written
   solution after the last ``</think>`` is the reference. ``"ground_truth"`` uses the dataset's worked
   solution as it is (trusted, not verified). A group without a reference keeps its plain GRPO advantages
   (``fm_fallback_no_reference``).
3. Judging: each failed rollout of a group with a reference is split into numbered sentences ``[1] .. [n]``
   (``split_sentences``) and shown to the teacher with the problem and the reference, in batched
   calls. The teacher ends with ``\\boxed{correct}`` or ``\\boxed{k}``, k the first sentence with a genuine,
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

The judge is any ``generate(prompt_texts) -> replies`` callable (``teacher.Judge``, with the prompts and the reading
of the replies); ``teacher.SamplerGenerate`` and ``teacher.load_generate`` build one from a model in memory or a
Hugging Face directory, sampled by the project's JAX sampler or by an engine with ``generate_arrays``
(``VLLMSampler``). A rollout's sentences and their tokens are ``sentences``'; this module is the step's use of both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lspo_jax.methods.first_mistake.config import FirstMistakeConfig
from lspo_jax.methods.first_mistake.sentences import (
    Span,
    batch_decode,
    sentence_token_starts,
    split_sentences,
    token_char_ends,
)
from lspo_jax.methods.first_mistake.teacher import (
    CORRECT,
    MISTAKE,
    OUT_OF_RANGE,
    UNPARSEABLE,
    Judge,
    Verdict,
    written_solution,
)


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
    check: Callable[[], None] | None = None,
) -> tuple[np.ndarray, dict[str, Any]]:
    """``([N, L] token advantages, metrics)`` of one RL batch of G groups of K rollouts (module docstring).

    ``valid`` (``[N]`` bool, optional) marks the rows of groups smaller than K (the rest is padding with no
    tokens): a group is mixed, and a row judged, on its valid rows alone. ``check`` (optional) is called between the
    teacher's batches and stages, and may raise to end the step's judging there (a stop: ``phases.Phases.within``).

    Per group: ``problems``, ``golds`` and ``references`` (the dataset's worked solutions, needed for
    ``reference="ground_truth"``). Per row: the verifier's ``response_texts``, the ``response_ids`` they
    decode from (``response_mask[i]`` has ``len(response_ids[i])`` ones), ``truncated`` (ended without EOS),
    ``accuracy`` (0/1) and ``outcome_adv``. ``score(texts, golds)`` is the verifier, run on the teacher's
    solutions. ``generate`` calls of at most ``Judge.max_batch`` prompts. Metrics (counts unless named a rate or mean):
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
    mixed_G = _mixed_groups(correct_N, valid_N, k)
    metrics: dict[str, Any] = {"fm_groups": len(mixed_G), "fm_skipped_zero_variance": int((~mixed_G).sum())}
    refs = _references(np.flatnonzero(mixed_G), problems, golds, references, score, judge, config, metrics, check)
    tally = _Tally()
    rows = [i for i in range(n) if i // k in refs and valid_N[i]]
    asked, spans = _to_judge(rows, response_texts, np.asarray(truncated, bool), correct_N, config, tally)
    if check is not None and config.reference != "ground_truth":  # between the teacher's two stages
        check()
    verdicts = judge.locate(
        [problems[i // k] for i in asked], [refs[i // k] for i in asked], [response_texts[i] for i in asked], spans,
        check,
    )  # fmt: skip
    pitfall_N = _pitfall_tokens(asked, spans, verdicts, correct_N, response_texts, response_ids, tokenizer, tally)
    judged_G = _judged_groups(pitfall_N, k, len(mixed_G))
    metrics.update(tally.metrics(), fm_groups_judged=len({i // k for i in asked}), fm_rollouts_judged=len(asked))
    metrics["fm_groups_reshaped"] = int(judged_G.sum())
    adv = token_advantages(outcome_adv, correct_N, pitfall_N, response_mask, k, judged_G, lam=config.lam)
    return adv, metrics


def _mixed_groups(correct_N: np.ndarray, valid_N: np.ndarray, k: int) -> np.ndarray:
    """``[G]``: the groups with a correct and a failed rollout among their valid rows, the only ones a judged
    pitfall can reshape (in the others every outcome advantage is 0)."""
    correct_GK, valid_GK = correct_N.reshape(-1, k), valid_N.reshape(-1, k)
    return (correct_GK & valid_GK).any(axis=1) & (~correct_GK & valid_GK).any(axis=1)


def _pitfall_tokens(asked, spans, verdicts, correct_N, response_texts, response_ids, tokenizer, tally) -> np.ndarray:
    """``[N]``: each judged row's pitfall token as its verdict reads (``_Tally.read``, which counts the fallbacks),
    -1 on the rows not asked about."""
    pitfall_N = np.full(len(correct_N), -1, np.int64)
    for i, split, verdict in zip(asked, spans, verdicts, strict=True):
        pitfall_N[i] = tally.read(verdict, bool(correct_N[i]), response_texts[i], response_ids[i], split, tokenizer)
    return pitfall_N


def _judged_groups(pitfall_N: np.ndarray, k: int, groups: int) -> np.ndarray:
    """``[G]``: the groups with at least one row whose pitfall the judge located."""
    judged_G = np.zeros(groups, bool)
    judged_G[np.flatnonzero(pitfall_N > 0) // k] = True
    return judged_G


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


def _references(groups, problems, golds, references, score, judge, config, metrics, check=None) -> dict[int, str]:
    """Group -> reference solution, for the groups that have a verified one (stage 1 when ``teacher``)."""
    refs: dict[int, str] = {}
    if config.reference == "ground_truth":
        for g in groups:
            text = references[g] if references is not None else None
            if text is not None and text.strip():
                refs[int(g)] = text
        metrics["fm_teacher_solve_rate"] = None
    else:
        solutions = judge.solve([problems[g] for g in groups], check)
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
    if batch_decode(tokenizer, [[int(t) for t in ids]])[0] != text:
        return None
    return sentence_token_starts([spans[sentence - 1]], token_char_ends(tokenizer, ids))[0]
