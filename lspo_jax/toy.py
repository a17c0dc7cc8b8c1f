"""A small generated math task with worked solutions, and a character tokenizer for it.

The CPU demo needs a task where the RL step has something to learn, cliffs really occur and a worked
solution really helps, with nothing downloaded. Column addition fits: the worked solution spells out each
column with its carry. The warm-started policy learned 1-3 digit sums from a teacher who forgets carries,
so the verifier's reward has a habit to remove (what GRPO alone can learn), and it never saw a 4-digit sum,
which it therefore fails K of K times (the cliff class) while a worked solution shows the extra column.
Rows follow the shared data schema ``{"id", "problem", "answer", "solution", "source", "meta"}``.
"""

from __future__ import annotations

import os
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


def addition_solution(a: int, b: int, forget_carry: float = 0.0, rng: np.random.Generator | None = None) -> str:
    """Column addition, least significant digit first: ``7+5=12;4+8+1=13;\\boxed{132}``.

    With ``forget_carry`` > 0 it is a sloppy teacher's: each carry is dropped with that probability (a draw of
    ``rng`` per carry), and the boxed answer follows the columns as written, so it is wrong.
    """
    steps, carry, digits = [], 0, []
    da, db = str(a)[::-1], str(b)[::-1]
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        if carry and forget_carry and rng.random() < forget_carry:
            carry = 0
        terms = f"{x}+{y}" + (f"+{carry}" if carry else "")
        total = x + y + carry
        steps.append(f"{terms}={total}")
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
) -> list[dict]:
    """``n`` distinct problems ``a+b=`` with a and b of ``digits[0]..digits[1]`` digits each, none of whose
    problem text is in ``exclude`` (so training rows can keep clear of the held-out sets). Solutions are
    correct, or a sloppy teacher's with ``teacher = (forget_carry, rng)`` (``addition_solution``)."""
    rng = np.random.default_rng(seed)
    rows, seen = [], set(exclude)
    while len(rows) < n:
        da, db = rng.integers(digits[0], digits[1] + 1, size=2)
        a = int(rng.integers(10 ** (da - 1) if da > 1 else 0, 10**da))
        b = int(rng.integers(10 ** (db - 1) if db > 1 else 0, 10**db))
        if f"{a}+{b}=" in seen:
            continue
        seen.add(f"{a}+{b}=")
        rows.append(
            {
                "id": f"{prefix}-{seed}-{len(rows)}",
                "problem": f"{a}+{b}=",
                "answer": str(a + b),
                "solution": addition_solution(a, b, *(teacher or ())),
                "source": "toy-addition",
                "meta": {"digits": [int(da), int(db)]},
            }
        )
    return rows


# The RL task's difficulty classes, by the digits of both operands. The warm start sees sums of 1-3 digits,
# so 2-digit sums are mostly solved, 3-digit ones are the frontier, and 4-digit ones (a column more than the
# warm start ever wrote) are solved 0 of K times: the cliff class, by construction.
CLASSES = {"2digit": 2, "3digit": 3, "4digit_cliff": 4}
HELDOUT_PER_CLASS = 64
HELDOUT_SPECS = tuple(f"toy:heldout_{name}" for name in CLASSES)  # the demo's benchmarks, one per class


def class_heldout_rows(name: str, n: int = HELDOUT_PER_CLASS) -> list[dict]:
    """The fixed held-out problems of one difficulty class (``CLASSES``): the same for every run seed, so paired
    seeds are scored on the same problems, and never among the training rows (``training_rows``)."""
    digits = CLASSES[name]
    return addition_rows(n, (digits, digits), seed=10_000 + digits, prefix=f"heldout-{name}")


def training_rows(n: int = 3000, seed: int = 0) -> list[dict]:
    """The RL prompts: equal shares of the classes, shuffled by ``seed``, none of them a held-out problem."""
    held = frozenset(row["problem"] for name in CLASSES for row in class_heldout_rows(name))
    rows = []
    for i, digits in enumerate(CLASSES.values()):
        share = n // len(CLASSES) + (i < n % len(CLASSES))
        rows += addition_rows(share, (digits, digits), seed=seed * 10 + i, prefix=f"train{digits}", exclude=held)
    order = np.random.default_rng(seed).permutation(len(rows))
    return [rows[i] for i in order]


def first_mistake_judge(prompt: str) -> str:
    """A scripted teacher for the addition task's first-mistake judge (``first_mistake.JUDGE_TEMPLATE``).

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


def model_config(max_positions: int = 256):
    """The demo's policy shape: a 3-layer Qwen2 of about 0.5M parameters over the character vocabulary."""
    from lspo_jax.config import LoraConfig, ModelConfig

    return ModelConfig(
        vocab_size=vocab_size(), hidden_size=128, intermediate_size=384, num_layers=3, num_heads=4,
        num_kv_heads=2, head_dim=32, max_position_embeddings=max_positions, tie_word_embeddings=True,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, lora=LoraConfig(rank=8, alpha=32.0),
    )  # fmt: skip


SHIPPED_MODEL = os.path.join(os.path.dirname(__file__), "assets", "toy_model")


def model_dir(cache_dir: str) -> str:
    """The warm-started demo model: the copy shipped with the package (made by ``tools/make_toy_model.py``),
    or one trained into ``cache_dir`` at first use when the package was installed without it."""
    if os.path.exists(os.path.join(SHIPPED_MODEL, "config.json")):
        return SHIPPED_MODEL
    return ensure_model(cache_dir)


# The warm start's teacher drops each carry with this probability: a habit the RL step can remove.
FORGET_CARRY = 0.4
WARM_START_STEPS = 1200


def ensure_model(
    directory: str,
    *,
    steps: int = WARM_START_STEPS,
    seed: int = 0,
    max_positions: int = 256,
    forget_carry: float = FORGET_CARRY,
) -> str:
    """The demo's warm-started policy as a Hugging Face directory, trained here at first use (a few minutes).

    Full-parameter SFT on 1-3 digit sums written by a sloppy teacher who drops each carry with probability
    ``forget_carry`` (its boxed answer then wrong): the policy learns the format, most short columns and the
    habit, which the verifier's reward can remove, and never a 4-digit sum, which become the RL task's cliffs.
    ``steps=0`` keeps the random init; with ``max_positions`` of a few thousand that is a tiny real judge
    model for the first-mistake option, whose prompts (the judge template and a numbered rollout) are about a
    thousand characters.
    """
    import shutil

    if os.path.exists(os.path.join(directory, "config.json")):
        return directory
    from lspo_jax import hf

    config = model_config(max_positions)
    tokenizer = char_tokenizer()
    base = _warm_start(config, tokenizer, steps=steps, seed=seed, forget_carry=forget_carry)
    staging = directory + ".tmp"
    shutil.rmtree(staging, ignore_errors=True)
    hf.save_pretrained(staging, config, {"base": base})
    tokenizer.save_pretrained(staging)
    os.replace(staging, directory)  # atomic: a crash never leaves a half-written model behind
    return directory


def _warm_start(config, tokenizer, *, steps: int, seed: int, forget_carry: float, batch: int = 64):
    import jax
    import optax

    from lspo_jax import data, losses, model, optim, rollout
    from lspo_jax.train_config import DataConfig

    base = model.init_params(config, jax.random.key(seed))["base"]
    if steps == 0:
        return base  # the random init: what tests want, without encoding the warm-start rows
    teacher = (forget_carry, np.random.default_rng(seed + 123))
    rows = addition_rows(6000, (1, 3), seed=seed + 1, prefix="warm", teacher=teacher)
    examples, _ = data.encode_rows(rows, tokenizer, DataConfig(), instruction=False)  # the task's own format
    prompt_slots = max(len(ex.prompt_ids) for ex in examples)
    target_slots = max(len(ex.solution_ids) for ex in examples)
    sft = rollout.pack_sft(
        [ex.prompt_ids for ex in examples], [ex.solution_ids for ex in examples], prompt_slots, target_slots
    )
    tx = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 3e-3, 50, steps, 3e-4), weight_decay=0.01)
    opt_state = tx.init(base)

    @jax.jit
    def step(base, opt_state, batch):
        def loss_fn(b):
            logp, _ = optim.sequence_logprobs(config, {"base": b}, batch["tokens"], batch["attention_mask"])
            return losses.sft_loss(logp, batch["mask"])

        loss, grads = jax.value_and_grad(loss_fn)(base)
        updates, opt_state = tx.update(grads, opt_state, base)
        return optax.apply_updates(base, updates), opt_state, loss

    rng = np.random.default_rng(seed)
    for _ in range(steps):
        idx = rng.choice(len(examples), batch, replace=False)
        base, opt_state, loss = step(base, opt_state, {k: v[idx] for k, v in sft.items()})
    return base
