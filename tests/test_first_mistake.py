"""First-mistake advantages: hand-computed token advantages, the reply parser, sentence splitting and its token
map (character and BPE tokenizers), the batch function with a scripted judge, and a tiny random judge model."""

from types import SimpleNamespace

import numpy as np
import pytest

from lspo_jax.job import toy_model
from lspo_jax.job.config_io import from_dict
from lspo_jax.methods.first_mistake.advantages import first_mistake_advantages, token_advantages
from lspo_jax.methods.first_mistake.config import FirstMistakeConfig
from lspo_jax.methods.first_mistake.sentences import sentence_token_starts, split_sentences, token_char_ends
from lspo_jax.methods.first_mistake.teacher import (
    CORRECT,
    MISTAKE,
    OUT_OF_RANGE,
    UNPARSEABLE,
    Judge,
    SamplerGenerate,
    Verdict,
    make_judge,
    parse_verdict,
)
from lspo_jax.rollout.samples import SampleBatch
from lspo_jax.tasks import toy


def _texts(text, spans):
    return [text[start:end] for start, end in spans]


# ------------------------------------------------------------------------------------------------- config
def test_config_defaults_and_errors_name_the_field():
    config = FirstMistakeConfig()
    assert (config.judge_path, config.reference, config.lam, config.enabled) == (None, "teacher", 0.0, False)
    assert config.teacher_temperature == 0.6  # the method's own setting
    for field, value in [
        ("reference", "oracle"),
        ("lam", -0.1),
        ("lam", float("nan")),
        ("max_new_tokens", 0),
        ("teacher_temperature", -1.0),
        ("max_sentences", 0),
        ("max_batch", 0),
        ("judge_path", " "),
    ]:
        # An option is checked with its section's key; a field by the dataclass's own check, which names its class.
        key = f"first_mistake.{field}" if field == "reference" else f"FirstMistakeConfig.{field}"
        with pytest.raises(ValueError, match=f"^{key}:"):
            FirstMistakeConfig(**{field: value})


# -------------------------------------------------------------------------------------- token advantages
# Rows are [prompt slot, prompt slot | 4 response slots] (P = 2, L = 6), K = 3, three groups:
#   group 0 (judged, mixed):  r0 passes, A = +1.0, 2 tokens, pitfall 1 (ignored: it passed)
#                             r1 fails,  A = -0.5, 4 tokens, pitfall 2 (tokens 0, 1 are the valid prefix)
#                             r2 fails,  A = -0.5, 3 tokens, pitfall -1 (none)
#   group 1 (judged, all fail: zero variance), group 2 (mixed, not judged): both must come out unchanged.
P, L, K = 2, 6, 3
LENGTHS = [2, 4, 3, 3, 4, 2, 1, 4, 2]
ADV = [1.0, -0.5, -0.5, -0.2, 0.1, 0.1, 0.8, -0.4, -0.4]
CORRECT_ROWS = [1, 0, 0, 0, 0, 0, 1, 0, 0]
PITFALL = [1, 2, -1, 1, 2, 1, -1, 2, 1]
JUDGED = [True, True, False]


def _mask(lengths, prompt_slots=P, length=L):
    mask = np.zeros((len(lengths), length), np.int32)
    for i, n in enumerate(lengths):
        mask[i, prompt_slots : prompt_slots + n] = 1
    return mask


def _plain(adv, mask):
    return np.asarray(adv, np.float32)[:, None] * mask


def test_token_advantages_lambda_zero_hand_computed():
    out = token_advantages(ADV, CORRECT_ROWS, PITFALL, _mask(LENGTHS), K, JUDGED, lam=0.0)
    # Group 0 before recentring: r0 [1, 1]; r1 [0, 0, -0.5, -0.5]; r2 [-0.5, -0.5, -0.5].
    # b = (2 - 1 - 1.5) / (2 + 4 + 3) = -0.5 / 9 = -1/18, and every token gets -b = +1/18:
    #   r0 = 1 + 1/18 = 19/18;  r1 prefix = 1/18, suffix = -0.5 + 1/18 = -4/9;  r2 = -4/9.
    b = -1 / 18
    np.testing.assert_allclose(out[0, P : P + 2], [1 - b] * 2, rtol=1e-6)
    np.testing.assert_allclose(out[1, P : P + 4], [-b, -b, -0.5 - b, -0.5 - b], rtol=1e-6)
    np.testing.assert_allclose(out[2, P : P + 3], [-0.5 - b] * 3, rtol=1e-6)
    assert abs(out[:3].sum()) < 1e-6  # recentred: zero mean over the group's response tokens
    # Zero-variance group 1 and non-judged group 2: A_i broadcast, exactly; zero off the mask everywhere.
    np.testing.assert_array_equal(out[3:], _plain(ADV, _mask(LENGTHS))[3:])
    assert not out[_mask(LENGTHS) == 0].any()
    assert out.dtype == np.float32 and out.shape == (9, L)


def test_token_advantages_lambda_half_hand_computed():
    out = token_advantages(ADV, CORRECT_ROWS, PITFALL, _mask(LENGTHS), K, JUDGED, lam=0.5)
    # r1 prefix = 0.5 * |-0.5| = 0.25; sum = 2 + (0.25 + 0.25 - 0.5 - 0.5) - 1.5 = 0, so b = 0:
    #   r0 keeps A = 1 on both tokens (a passing rollout is never reshaped, only recentred, here by 0).
    np.testing.assert_allclose(out[0, P : P + 2], [1.0, 1.0], atol=1e-7)
    np.testing.assert_allclose(out[1, P : P + 4], [0.25, 0.25, -0.5, -0.5], atol=1e-7)
    np.testing.assert_allclose(out[2, P : P + 3], [-0.5] * 3, atol=1e-7)
    np.testing.assert_array_equal(out[3:], _plain(ADV, _mask(LENGTHS))[3:])


def test_token_advantages_follow_the_mask_not_a_fixed_start():
    # Same rows with 3 prompt slots: the response token j is the j-th masked column wherever it starts.
    shifted = token_advantages(ADV, CORRECT_ROWS, PITFALL, _mask(LENGTHS, 3, L + 1), K, JUDGED)
    original = token_advantages(ADV, CORRECT_ROWS, PITFALL, _mask(LENGTHS), K, JUDGED)
    np.testing.assert_array_equal(shifted[:, 3:], original[:, P:])


def test_token_advantages_without_pitfalls_or_judged_groups_are_plain():
    mask = _mask(LENGTHS)
    np.testing.assert_array_equal(token_advantages(ADV, CORRECT_ROWS, PITFALL, mask, K, [False] * 3), _plain(ADV, mask))
    with pytest.raises(ValueError, match="groups of 3"):
        token_advantages(ADV, CORRECT_ROWS, PITFALL, mask, K, [True])


# -------------------------------------------------------------------------------------------------- parser
@pytest.mark.parametrize(
    "reply, expected",
    [
        ("The work is fine.\n\\boxed{correct}", Verdict(CORRECT)),
        ("Sentence 3 divides by zero. \\boxed{3}", Verdict(MISTAKE, 3)),
        ("\\boxed{\\text{Correct}}", Verdict(CORRECT)),
        ("\\boxed{[4]}", Verdict(MISTAKE, 4)),
        ("\\boxed{Sentence 4}", Verdict(MISTAKE, 4)),
        ("FIRST MISTAKE: 7", Verdict(MISTAKE, 7)),
        ("**First mistake:** [2], the sign flips", Verdict(MISTAKE, 2)),
        ("Verdict: no mistake.", Verdict(CORRECT)),
        # the last verdict wins
        ("Maybe \\boxed{2}? No: \\boxed{5}", Verdict(MISTAKE, 5)),
        ("\\boxed{4} ... on reflection the student corrects it. \\boxed{correct}", Verdict(CORRECT)),
        ("FIRST MISTAKE: 3\nthe final answer is \\boxed{maybe}", Verdict(UNPARSEABLE)),
        # thinking is ignored, whether closed or left open
        ("<think>it is \\boxed{2}</think>\\boxed{correct}", Verdict(CORRECT)),
        ("considering [2]...</think> FIRST MISTAKE: 6", Verdict(MISTAKE, 6)),
        ("\\boxed{correct} <think>\\boxed{2}", Verdict(CORRECT)),
        ("<think>\\boxed{2}</think> so it goes", Verdict(UNPARSEABLE)),
        # out of range
        ("\\boxed{0}", Verdict(OUT_OF_RANGE)),
        ("\\boxed{11}", Verdict(OUT_OF_RANGE)),
        ("\\boxed{-2}", Verdict(OUT_OF_RANGE)),
        ("\\boxed{" + "9" * 5000 + "}", Verdict(OUT_OF_RANGE)),
        # garbage
        ("", Verdict(UNPARSEABLE)),
        ("\\boxed{seven}", Verdict(UNPARSEABLE)),
        ("\\boxed{3.5}", Verdict(UNPARSEABLE)),
        ("\\boxed{}", Verdict(UNPARSEABLE)),
        ("I would say \\boxed{3", Verdict(UNPARSEABLE)),
        ("the first mistake is 2+2=5", Verdict(UNPARSEABLE)),
        ("Verdict: 3-5", Verdict(UNPARSEABLE)),
        ("Verdict: incorrect", Verdict(UNPARSEABLE)),
        ("}}}{{{\\boxed{{{", Verdict(UNPARSEABLE)),
    ],
)
def test_parse_verdict(reply, expected):
    assert parse_verdict(reply, 10) == expected


# ----------------------------------------------------------------------------------------------- sentences
@pytest.mark.parametrize(
    "text, expected",
    [
        ("First we add. Then we multiply? Yes! Done", ["First we add.", "Then we multiply?", "Yes!", "Done"]),
        ("x = 3.5 is e.g. a decimal.  Next\n\nline", ["x = 3.5 is e.g. a decimal.", "Next", "line"]),
        ("1. Compute a.\n2. Compute b.", ["1. Compute a.", "2. Compute b."]),
        (
            "So $$a = 1.\nb = 2.$$ Hence \\boxed{1. 2} holds. End",
            ["So $$a = 1.\nb = 2.$$ Hence \\boxed{1. 2} holds.", "End"],
        ),
        ("Take \\[x.\ny\\] and $p. q$ too. Ok", ["Take \\[x.\ny\\] and $p. q$ too.", "Ok"]),
        ("   \n ", []),
    ],
)
def test_split_sentences(text, expected):
    spans = split_sentences(text)
    assert _texts(text, spans) == expected
    assert all(text[s].strip() and text[e - 1].strip() for s, e in spans)  # stripped


def test_split_sentences_folds_the_rest_into_the_last():
    text = "One. Two. Three. Four."
    assert _texts(text, split_sentences(text, max_sentences=2)) == ["One.", "Two. Three. Four."]


def _bpe_tokenizer():
    """A byte-level BPE trained here on a few sentences, as transformers wraps it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<pad>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["We add the numbers. Then we multiply them.", "So the answer is 42."] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>")


SENTENCES_TEXT = "We add 3.5 and 2. Then we multiply them ≤ π. So the answer is \\boxed{5.5}."


@pytest.mark.parametrize("make_tokenizer", [toy.char_tokenizer, _bpe_tokenizer])
def test_sentence_token_starts(make_tokenizer):
    tokenizer = make_tokenizer()
    text = SENTENCES_TEXT if make_tokenizer is _bpe_tokenizer else SENTENCES_TEXT.lower().replace(" ≤ π", "")
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    ends = token_char_ends(tokenizer, ids)
    np.testing.assert_array_equal(ends, token_char_ends(tokenizer, ids, window=None))  # windowed == every prefix
    spans = split_sentences(text)
    assert len(spans) == 3
    for (start, _), token in zip(spans, sentence_token_starts(spans, ends), strict=True):
        # The token holds the sentence's first character: text before it ends at or before the start.
        assert len(tokenizer.decode(ids[:token])) <= start < len(tokenizer.decode(ids[: token + 1]))
    if make_tokenizer is toy.char_tokenizer:  # one token per character
        assert sentence_token_starts(spans, ends) == [start for start, _ in spans]


# ----------------------------------------------------------------------------------------- the batch step
# Toy char tokenizer: one token per character, so a sentence's token index is its character offset.
RESPONSE = "2+2=4. so x=5. thus \\boxed{9}."  # sentences start at characters 0, 7 and 15


class ScriptedJudge:
    """``generate``: a canned reply per prompt (chosen by a marker in it), and a record of every call."""

    def __init__(self, solutions, verdicts):
        self.solutions, self.verdicts, self.calls = solutions, verdicts, []

    def __call__(self, prompts):
        self.calls.append(list(prompts))
        if prompts[0].startswith("Solve"):
            return [self.solutions[p.split("\n\n")[-1]] for p in prompts]
        return [self.verdicts[p.split("Problem:\n")[1].split("\n")[0]].pop(0) for p in prompts]


def _batch(accuracy, truncated=None, texts=None):
    tokenizer = toy.char_tokenizer()
    n = len(accuracy)
    texts = texts or [RESPONSE] * n
    ids = [tokenizer.encode(RESPONSE, add_special_tokens=False) for _ in range(n)]
    mask = _mask([len(x) for x in ids], prompt_slots=4, length=4 + 40)
    adv = np.linspace(-1.0, 1.0, n).astype(np.float32)
    return dict(
        response_texts=texts, response_ids=ids, response_mask=mask, accuracy=np.asarray(accuracy, np.float32),
        truncated=np.zeros(n, bool) if truncated is None else np.asarray(truncated), outcome_adv=adv,
        group_size=3, tokenizer=tokenizer,
    )  # fmt: skip


def _boxed_score(texts, golds):
    """A fake verifier: the text ends with the gold in a box."""
    return [float(t.endswith(f"\\boxed{{{g}}}")) for t, g in zip(texts, golds, strict=True)]


def test_batch_with_scripted_teacher():
    # K = 3. g0 mixed: r1 mistake at [2], r2 at [3]. g1 all fail (skipped). g2 mixed, teacher's solution
    # wrong (no reference). g3 mixed: r0 truncated, r1 "correct". g4 mixed: r1 garbage, r2 out of range.
    accuracy = [1, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1, 1, 0, 0]
    truncated = [0] * 9 + [1] + [0] * 5
    problems = ["p0", "p1", "p2", "p3", "p4"]
    golds = ["4", "4", "4", "4", "4"]
    solutions = {p: "<think>hm</think>so \\boxed{4}" for p in problems} | {"p2": "\\boxed{5}"}
    verdicts = {
        "p0": ["look: \\boxed{2}", "FIRST MISTAKE: 3"],
        "p3": ["<think>\\boxed{1}</think>\\boxed{correct}"],
        "p4": ["no idea", "\\boxed{4}"],
    }
    judge_fn = ScriptedJudge(solutions, verdicts)
    batch = _batch(accuracy, truncated)
    config = FirstMistakeConfig(lam=0.5)
    adv, metrics = first_mistake_advantages(
        problems=problems, golds=golds, references=None, score=_boxed_score, judge=Judge(judge_fn), config=config,
        **batch,
    )  # fmt: skip
    assert [len(c) for c in judge_fn.calls] == [4, 5]  # one batched call per stage: g0, g2, g3, g4; 5 rollouts
    assert "[2] so x=5." in judge_fn.calls[1][0] and "Reference solution:\nso \\boxed{4}" in judge_fn.calls[1][0]
    pitfall = np.full(15, -1)
    pitfall[1], pitfall[2] = 7, 15
    expected = token_advantages(batch["outcome_adv"], np.asarray(accuracy) > 0, pitfall, batch["response_mask"], 3,
                                [True, False, False, False, False], lam=0.5)  # fmt: skip
    np.testing.assert_allclose(adv, expected, rtol=1e-6)
    np.testing.assert_array_equal(adv[3:], _plain(batch["outcome_adv"], batch["response_mask"])[3:])
    assert metrics == {
        "fm_groups": 5,
        "fm_skipped_zero_variance": 1,
        "fm_fallback_no_reference": 1,
        "fm_teacher_solve_rate": 0.75,
        "fm_groups_judged": 3,
        "fm_groups_reshaped": 1,
        "fm_rollouts_judged": 5,
        "fm_pitfalls": 2,
        "fm_judge_said_correct": 1,
        "fm_judge_agreement": pytest.approx(2 / 3),  # two mistakes on failures agree, one "correct" does not
        "fm_pitfall_rel_pos_mean": pytest.approx((7 + 15) / 2 / len(RESPONSE)),
        "fm_fallback_truncated": 1,
        "fm_fallback_empty": 0,
        "fm_fallback_unparseable": 1,
        "fm_fallback_out_of_range": 1,
        "fm_fallback_token_map": 0,
    }


def test_batch_with_ground_truth_references():
    # g0: r1 mistake at [2] but its text is not its tokens' decoding; r2 mistake at [1] (no valid prefix).
    # g1 has no worked solution. judge_correct also shows r0 (passing), judged correct: all three agree.
    texts = [RESPONSE, RESPONSE.upper(), RESPONSE, RESPONSE, RESPONSE, RESPONSE]
    judge_fn = ScriptedJudge({}, {"p0": ["\\boxed{correct}", "\\boxed{2}", "\\boxed{1}"]})
    batch = _batch([1, 0, 0, 0, 1, 0], texts=texts)
    config = FirstMistakeConfig(reference="ground_truth", judge_correct=True)
    adv, metrics = first_mistake_advantages(
        problems=["p0", "p1"], golds=["4", "4"], references=["2+2=4. \\boxed{4}", None], score=_boxed_score,
        judge=Judge(judge_fn), config=config, **batch,
    )  # fmt: skip
    assert len(judge_fn.calls) == 1 and len(judge_fn.calls[0]) == 3  # no stage 1
    np.testing.assert_array_equal(adv, _plain(batch["outcome_adv"], batch["response_mask"]))
    assert metrics["fm_fallback_no_reference"] == 1 and metrics["fm_teacher_solve_rate"] is None
    assert metrics["fm_fallback_token_map"] == 1 and metrics["fm_pitfalls"] == 1
    assert metrics["fm_groups_reshaped"] == 0 and metrics["fm_pitfall_rel_pos_mean"] == 0.0
    assert metrics["fm_judge_agreement"] == pytest.approx(1.0)


def test_judge_checks_templates_and_reply_count():
    with pytest.raises(ValueError, match="judge_template"):
        Judge(lambda prompts: prompts, judge_template="{problem} {missing}")
    with pytest.raises(ValueError, match="2 prompts"):
        Judge(lambda prompts: ["x"]).solve(["a", "b"])


def test_batch_without_mixed_groups_calls_nothing():
    judge_fn = ScriptedJudge({}, {})
    batch = _batch([1, 1, 1, 0, 0, 0])
    adv, metrics = first_mistake_advantages(
        problems=["p0", "p1"], golds=["4", "4"], references=None, score=_boxed_score, judge=Judge(judge_fn),
        config=FirstMistakeConfig(), **batch,
    )  # fmt: skip
    assert judge_fn.calls == [] and metrics["fm_skipped_zero_variance"] == 2
    assert metrics["fm_teacher_solve_rate"] is None and metrics["fm_judge_agreement"] is None
    np.testing.assert_array_equal(adv, _plain(batch["outcome_adv"], batch["response_mask"]))


def test_sampler_generate_goes_through_an_engine():
    class FakeEngine:
        def generate_arrays(self, params, prompts, **options):
            # The default teacher samples at 0.6, the method's setting.
            assert not options["greedy"] and options["temperature"] == 0.6 and options["n"] == 1
            assert params == "params"
            rows = len(prompts)
            tokens = np.tile(np.asarray(tokenizer.encode("\\boxed{2}"), np.int32), (rows, 1))
            return SampleBatch(tokens, np.zeros(tokens.shape, np.float32), np.full(rows, 9), np.ones(rows, bool), 1, 9)

    tokenizer = toy.char_tokenizer()
    policy = SimpleNamespace(config=toy_model.model_config(), tokenizer=tokenizer, eos_ids=(2,))
    with pytest.raises(ValueError, match="policy judges itself"):
        make_judge(FirstMistakeConfig())
    config = FirstMistakeConfig(max_new_tokens=9, max_batch=2)
    generate = make_judge(config, policy=policy, params="params", engine=FakeEngine()).generate
    assert isinstance(generate, SamplerGenerate) and generate.max_new_tokens == 9
    too_long = "1" * policy.config.max_position_embeddings
    assert generate(["a", "b", too_long, "c"]) == ["\\boxed{2}", "\\boxed{2}", "", "\\boxed{2}"]
    assert generate.calls == 2  # max_batch prompts per engine call; the one too long is never sent


def test_tiny_random_judge_falls_back_to_grpo(hf_untied_dir):
    """A random Qwen2 judge served by the JAX sampler: its replies are garbage, so every judged failure is
    counted as unparseable (or out of range) and the advantages are the plain GRPO ones."""
    generate = make_judge(FirstMistakeConfig(judge_path=hf_untied_dir, max_new_tokens=6)).generate
    calls = []

    def counted(prompts):
        calls.append(len(prompts))
        return generate(prompts)

    # The fixture's vocabulary is tiny: short templates keep the prompts within its 256 positions.
    judge = Judge(counted, solve_template="{problem}", judge_template="{problem}={reference}:{solution}")
    batch = _batch([1, 0, 0, 0, 1, 0])
    adv, metrics = first_mistake_advantages(
        problems=["2+2", "1+3"], golds=["4", "4"], references=None, judge=judge, config=FirstMistakeConfig(),
        score=lambda texts, golds: [1.0] * len(texts),  # accept the teacher's garbage, so stage 2 runs
        **batch,
    )  # fmt: skip
    assert calls == [2, 4] and generate.calls == 2  # both stages were sampled, one sampler call each
    assert metrics["fm_groups_judged"] == 2 and metrics["fm_rollouts_judged"] == 4
    assert metrics["fm_fallback_unparseable"] + metrics["fm_fallback_out_of_range"] == 4
    assert metrics["fm_groups_reshaped"] == 0 and metrics["fm_pitfalls"] == 0
    np.testing.assert_array_equal(adv, _plain(batch["outcome_adv"], batch["response_mask"]))


def test_config_reads_as_a_run_config_section():
    config = from_dict(FirstMistakeConfig, {"lam": 1, "judge_path": None, "reference": "ground_truth"})
    assert config == FirstMistakeConfig(lam=1.0, reference="ground_truth")
    with pytest.raises(ValueError, match=r"^first_mistake\.lam: must be a finite number >= 0, got -1"):
        from_dict(FirstMistakeConfig, {"lam": -1}, "first_mistake.")


def test_extra_sentence_breaks_split_a_chained_worked_answer():
    text = "5+3=8;6+7=13;8+6+1=15;\\boxed{1538}"
    assert split_sentences(text) == [(0, len(text))]  # no sentence end without the extra break
    spans = split_sentences(text, None, ";")
    assert [text[a:b] for a, b in spans] == ["5+3=8;", "6+7=13;", "8+6+1=15;", "\\boxed{1538}"]
    assert split_sentences("x={a;b};y", None, ";") == [(0, 8), (8, 9)]  # not inside braces


def test_padding_rows_of_unequal_groups_are_neither_judged_nor_mixing():
    """Groups of 3 slots: group 0 holds [pass, fail] and a padding slot, group 1 [pass, pass] and a padding
    slot. Group 0 is mixed and its one failed row judged; group 1 is all-pass on its valid rows (padding's
    accuracy 0 does not make it mixed), so it is skipped."""
    batch = _batch([1, 0, 0, 1, 1, 0])
    replies = []

    def judge(prompts):
        replies.extend(prompts)
        return ["\\boxed{correct}"] * len(prompts)

    _, metrics = first_mistake_advantages(
        problems=["2+2", "1+3"], golds=["4", "4"], references=["4", "4"], judge=Judge(judge), score=_boxed_score,
        config=FirstMistakeConfig(reference="ground_truth"), valid=np.array([1, 1, 0, 1, 1, 0], bool), **batch,
    )  # fmt: skip
    assert metrics["fm_skipped_zero_variance"] == 1 and metrics["fm_groups_judged"] == 1
    assert metrics["fm_rollouts_judged"] == 1 and len(replies) == 1
