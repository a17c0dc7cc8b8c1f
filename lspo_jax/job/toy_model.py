"""The demo's policy: a tiny Qwen2 over the toy task's character vocabulary, warm-started by supervised training.

``model_dir`` gives the copy shipped with the package (``lspo_jax/assets/toy_model``, made by
``tools/make_toy_model.py``), or trains one at first use. The task itself (rows, tokenizer, scripted judge) is
``toy``, which the data layer reads; this module builds on the data layer.
"""

from __future__ import annotations

import os
import shutil

import jax
import numpy as np
import optax

from lspo_jax.config import LoraConfig, ModelConfig
from lspo_jax.models import hf, specs
from lspo_jax.rl import logprobs, losses, packing
from lspo_jax.tasks import data, toy
from lspo_jax.train_config import DataConfig


def model_config(max_positions: int = 256):
    """The demo's policy shape: a 3-layer Qwen2 of about 0.5M parameters over the character vocabulary."""
    return ModelConfig(
        vocab_size=toy.vocab_size(), hidden_size=128, intermediate_size=384, num_layers=3, num_heads=4,
        num_kv_heads=2, head_dim=32, max_position_embeddings=max_positions, tie_word_embeddings=True,
        bos_token_id=toy.BOS_ID, eos_token_id=toy.EOS_ID, lora=LoraConfig(rank=8, alpha=32.0),
    )  # fmt: skip


SHIPPED_MODEL = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "toy_model")


def model_dir(cache_dir: str) -> str:
    """The warm-started demo model: the copy shipped with the package (made by ``tools/make_toy_model.py``),
    or one trained into ``cache_dir`` at first use when the package was installed without it."""
    if os.path.exists(os.path.join(SHIPPED_MODEL, "config.json")):
        return SHIPPED_MODEL
    return ensure_model(cache_dir)


# The warm start's teacher drops each carry with this probability: a habit the RL step can remove.
FORGET_CARRY = 0.4
WARM_START_STEPS = 1200
# The share of the warm start's rows that are three-operand sums (toy.warm_start_rows), chosen by
# tools/calibrate_frontier.py on seed 0 so that most frontier prompts are cliffs at K = 8 while the base
# still solves some of them within 64 samples (benchmarks/RESULTS.md).
FRONTIER_SHARE = 0.02


def ensure_model(
    directory: str,
    *,
    steps: int = WARM_START_STEPS,
    seed: int = 0,
    max_positions: int = 256,
    forget_carry: float = FORGET_CARRY,
    frontier_share: float = FRONTIER_SHARE,
) -> str:
    """The demo's warm-started policy as a Hugging Face directory, trained here at first use (a few minutes).

    Full-parameter SFT on 1-3 digit sums written by a sloppy teacher who drops each carry with probability
    ``forget_carry`` (its boxed answer then wrong): the policy learns the format, most short columns and the
    habit, which the verifier's reward can remove, a little of three-operand sums (``frontier_share`` of the
    rows: the frontier class) and never a 4-digit sum (the beyond-reach class).
    ``steps=0`` keeps the random init; with ``max_positions`` of a few thousand that is a tiny real judge
    model for the first-mistake option, whose prompts (the judge template and a numbered rollout) are about a
    thousand characters.
    """
    if os.path.exists(os.path.join(directory, "config.json")):
        return directory
    config = model_config(max_positions)
    tokenizer = toy.char_tokenizer()
    rows = toy.warm_start_rows(6000, frontier_share, forget_carry, seed) if steps else []
    base = _warm_start(config, tokenizer, rows, steps=steps, seed=seed)
    staging = directory + ".tmp"
    shutil.rmtree(staging, ignore_errors=True)
    hf.save_pretrained(staging, config, {"base": base})
    tokenizer.save_pretrained(staging)
    os.replace(staging, directory)  # atomic: a crash never leaves a half-written model behind
    return directory


def _warm_start(config, tokenizer, rows, *, steps: int, seed: int, batch: int = 64):
    base = specs.init_params(config, jax.random.key(seed))["base"]
    if steps == 0:
        return base  # the random init: what tests want, without encoding the warm-start rows
    examples, _ = data.encode_rows(rows, tokenizer, DataConfig(), instruction=False)  # the task's own format
    prompt_slots = max(len(ex.prompt_ids) for ex in examples)
    target_slots = max(len(ex.solution_ids) for ex in examples)
    sft = packing.pack_sft(
        [ex.prompt_ids for ex in examples], [ex.solution_ids for ex in examples], prompt_slots, target_slots
    )
    tx = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 3e-3, 50, steps, 3e-4), weight_decay=0.01)
    opt_state = tx.init(base)

    @jax.jit
    def step(base, opt_state, batch):
        def loss_fn(b):
            logp, _ = logprobs.sequence_logprobs(config, {"base": b}, batch["tokens"], batch["attention_mask"])
            return losses.sft_loss(logp, batch["mask"])

        loss, grads = jax.value_and_grad(loss_fn)(base)
        updates, opt_state = tx.update(grads, opt_state, base)
        return optax.apply_updates(base, updates), opt_state, loss

    rng = np.random.default_rng(seed)
    for _ in range(steps):
        idx = rng.choice(len(examples), batch, replace=False)
        base, opt_state, loss = step(base, opt_state, {k: v[idx] for k, v in sft.items()})
    return base
