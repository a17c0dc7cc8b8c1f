"""A small generated math task with worked solutions, and a character tokenizer for it.

The CPU demo needs a task where the RL step has something to learn, cliffs really occur and a worked
solution really helps, with nothing downloaded. Column addition fits: the worked solution spells out each
column with its carry. The warm-started policy learned 1-3 digit sums from a teacher who forgets carries,
so the verifier's reward has a habit to remove (what GRPO alone can learn); it saw a few three-operand sums,
which it therefore solves rarely (the frontier class: mostly cliffs, within reach), and never a 4-digit sum,
which it fails K of K times (the beyond-reach cliff class) while a worked solution shows the extra column.
Rows follow the shared data schema ``{"id", "problem", "answer", "solution", "source", "meta"}``.
"""

from __future__ import annotations

import string

import numpy as np

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
# Digits and symbols of the task, letters for "\boxed", and a few spare characters for prompts.
CHARS = string.digits + "+-*=;:,.()?{}\\ " + string.ascii_lowercase
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


def char_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` over ``CHARS`` (ids 0-3: pad, bos, eos, unk)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters join back without spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def vocab_size() -> int:
    return len(SPECIAL_TOKENS) + len(CHARS)


def addition_solution(*terms: int, forget_carry: float = 0.0, rng: np.random.Generator | None = None) -> str:
    """Column addition, least significant digit first: ``7+5=12;4+8+1=13;\\boxed{132}`` for 47+85, and any
    number of terms alike (``4+5+9=18;2+1+3+1=7;\\boxed{78}`` for 24+15+39; a carry may then be 2).

    With ``forget_carry`` > 0 it is a sloppy teacher's: each carry is dropped with that probability (a draw of
    ``rng`` per carry), and the boxed answer follows the columns as written, so it is wrong.
    """
    steps, carry, digits = [], 0, []
    columns = [str(t)[::-1] for t in terms]
    for i in range(max(len(c) for c in columns)):
        column = [int(c[i]) if i < len(c) else 0 for c in columns]
        if carry and forget_carry and rng.random() < forget_carry:
            carry = 0
        total = sum(column) + carry
        steps.append("+".join(map(str, column)) + (f"+{carry}" if carry else "") + f"={total}")
        digits.append(str(total % 10))
        carry = total // 10
    answer = int((str(carry) if carry else "") + "".join(reversed(digits)))
    return ";".join(steps) + f";\\boxed{{{answer}}}"


def addition_rows(
    n: int,
    digits: tuple[int, int],
    seed: int,
    prefix: str = "add",
    exclude: frozenset[str] = frozenset(),
    teacher: tuple[float, np.random.Generator] | None = None,
    terms: int = 2,
) -> list[dict]:
    """``n`` distinct problems ``a+b=`` (``terms`` operands) of ``digits[0]..digits[1]`` digits each, none of whose
    problem text is in ``exclude`` (so training rows can keep clear of the held-out sets). Solutions are
    correct, or a sloppy teacher's with ``teacher = (forget_carry, rng)`` (``addition_solution``)."""
    rng = np.random.default_rng(seed)
    rows, seen = [], set(exclude)
    while len(rows) < n:
        widths = rng.integers(digits[0], digits[1] + 1, size=terms)
        values = [int(rng.integers(10 ** (d - 1) if d > 1 else 0, 10**d)) for d in widths]
        problem = "+".join(map(str, values)) + "="
        if problem in seen:
            continue
        seen.add(problem)
        forget, teacher_rng = teacher or (0.0, None)
        rows.append(
            {
                "id": f"{prefix}-{seed}-{len(rows)}",
                "problem": problem,
                "answer": str(sum(values)),
                "solution": addition_solution(*values, forget_carry=forget, rng=teacher_rng),
                "source": "toy-addition",
                "meta": {"digits": [int(d) for d in widths]},
            }
        )
    return rows


# The RL task's difficulty classes: name -> (digits of each operand, operands). The warm start sees two-operand
# sums of 1-3 digits and a small share of three-operand 2-digit sums (``toy_model.FRONTIER_SHARE``), so 2-digit
# sums are mostly solved, 3-digit ones are learnable, three-operand sums are the frontier (most of their groups
# fail all K samples, yet the base writes a right one now and then), and 4-digit sums, a column more than the warm
# start ever wrote, are beyond its reach: solved 0 of K times by construction. The order keeps each class's
# training stream (its seed is its index) as it was before the frontier class came.
CLASSES = {"2digit": (2, 2), "3digit": (3, 2), "4digit_cliff_beyond": (4, 2), "3term_frontier": (2, 3)}
FRONTIER = "3term_frontier"
HELDOUT_PER_CLASS = 64
HELDOUT_SPECS = tuple(f"toy:heldout_{name}" for name in CLASSES)  # the demo's benchmarks, one per class


def class_seed(name: str) -> int:
    """The held-out stream of a class: two-operand classes keep the seed they always had (10,000 + digits)."""
    digits, terms = CLASSES[name]
    return 10_000 + digits + 100 * (terms - 2)


def class_heldout_rows(name: str, n: int = HELDOUT_PER_CLASS) -> list[dict]:
    """The fixed held-out problems of one difficulty class (``CLASSES``): the same for every run seed, so paired
    seeds are scored on the same problems, and never among the training rows (``training_rows``); the frontier
    class's are not among the warm start's either (``warm_start_rows``), whose two-operand rows may hold a few
    2-digit held-out problems (6 of 64 on seed 0), as they always did."""
    digits, terms = CLASSES[name]
    return addition_rows(n, (digits, digits), seed=class_seed(name), prefix=f"heldout-{name}", terms=terms)


def heldout_problems() -> frozenset[str]:
    return frozenset(row["problem"] for name in CLASSES for row in class_heldout_rows(name))


def training_rows(n: int = 3000, seed: int = 0) -> list[dict]:
    """The RL prompts: equal shares of the classes, shuffled by ``seed``, none of them a held-out problem."""
    held, rows = heldout_problems(), []
    for i, (digits, terms) in enumerate(CLASSES.values()):
        share = n // len(CLASSES) + (i < n % len(CLASSES))
        prefix = f"train{digits}" + (f"x{terms}" if terms != 2 else "")
        rows += addition_rows(
            share, (digits, digits), seed=seed * 10 + i, prefix=prefix, exclude=held, terms=terms
        )  # fmt: skip
    order = np.random.default_rng(seed).permutation(len(rows))
    return [rows[i] for i in order]


def warm_start_rows(n: int, frontier_share: float, forget_carry: float, seed: int) -> list[dict]:
    """The warm start's supervised rows, all by the sloppy teacher: two-operand 1-3 digit sums, and a
    ``frontier_share`` of them three-operand 2-digit sums (the frontier class's kind, none of its held-out
    problems), which give the base a low but non-zero skill there."""
    teacher = (forget_carry, np.random.default_rng(seed + 123))
    frontier = round(n * frontier_share)
    rows = addition_rows(n - frontier, (1, 3), seed=seed + 1, prefix="warm", teacher=teacher)
    if frontier:
        digits, terms = CLASSES[FRONTIER]
        rows += addition_rows(frontier, (digits, digits), seed=seed + 2, prefix="warm3term",
                              exclude=heldout_problems(), teacher=teacher, terms=terms)  # fmt: skip
    return rows


def first_mistake_judge(prompt: str) -> str:
    """A scripted teacher for the addition task's first-mistake judge (``teacher.JUDGE_TEMPLATE``).

    It knows the task: a worked solution is a chain of ``;``-separated column sums, so the first numbered
    student sentence that differs from the reference's sentence at the same place is the first mistake;
    a student who matches the reference throughout is ``correct``.
    """
    import re

    reference = re.search(r"Reference solution:\n(.*?)\n\n", prompt, re.S)
    student = re.findall(r"^\[(\d+)\] (.*)$", prompt, re.M)
    if reference is None or not student:
        return "I cannot read this prompt."
    steps = [step.strip() + ";" for step in reference.group(1).split(";")]
    steps[-1] = steps[-1][:-1]  # the boxed answer has no separator after it
    for number, sentence in student:
        index = int(number) - 1
        if index >= len(steps) or sentence.strip() != steps[index]:
            return f"The first wrong step is {number}. \\boxed{{{number}}}"
    return "\\boxed{correct}"


def heldout_rows(n: int = 64, seed: int = 0) -> list[dict]:
    """Held-out problems of the training difficulty, drawn from a stream the training rows never use."""
    return addition_rows(n, (2, 4), seed=10_000 + seed, prefix="heldout")


def target_rows(n: int = 64, seed: int = 0) -> list[dict]:
    """A target set of the training difficulty for a target-guided prompt sampler, from a third stream that
    neither the training rows nor the held-out rows use."""
    return addition_rows(n, (2, 4), seed=20_000 + seed, prefix="target")
