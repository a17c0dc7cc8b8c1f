"""Optimizers and update steps with strictly disjoint gradient routing.

Params are ``{"base": ..., "lora": ...}``. One ``optax.multi_transform`` holds an AdamW for each subtree:
the RL optimizer (lr 1e-6) for the base and the SFT optimizer (lr 2.5e-5) for the adapter. A step never
runs the combined update: handing the other subtree zero gradients would still move it (AdamW's weight
decay and its running moments produce non-zero updates from a zero gradient) and would advance the other
optimizer's step count, hence its bias correction and warm-up. Instead ``update_subtree`` runs only one
label's inner transform, the same computation ``multi_transform`` does for that label, so the other
subtree and its optimizer state stay bit-identical.

    rl_step:  loss = policy_loss(logp_theta) with lora_scale = 0   grad w.r.t. params["base"] only
    sft_step: loss = sft_loss(logp_theta+phi) with the adapter on  grad w.r.t. params["lora"] only

The controls that supervise the base itself break the routing on purpose: ``base_sft_step`` (the SFT loss, adapter
off, base only) and ``mixed_rl_step`` (the RL loss plus mu times the SFT loss, one update of the base).

LoRA RL (``optim.train: lora``) adds a third subtree, the persistent policy adapter ``params["policy"]`` (shape
``model.policy_lora``), and the policy becomes base + policy adapter, the base frozen:

    multi_transform({"base": set_to_zero, "policy": AdamW(rl), "lora": AdamW(sft)})
    rl_step:  loss = policy_loss(logp_{base+policy}), scaffold adapter off     grad w.r.t. params["policy"] only
    sft_step: loss = sft_loss(logp_{base+policy+lora})                          grad w.r.t. params["lora"] only

The base has no optimizer state (``set_to_zero`` keeps none) and is never written. The scaffold's adapter stacks on
the policy's: its SFT fit and its re-rolls see base + policy adapter + scaffold adapter (``model.decoder`` applies
both, each at its own multiplier), so a spliced row's ``old_logp`` is the stacked policy's log-prob while the
update's numerator is the policy's. ``rl_subtree`` names the subtree the RL update trains.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from lspo_jax import options
from lspo_jax.config import ModelConfig
from lspo_jax.models import specs
from lspo_jax.optim_config import AdamWConfig, RLOptimConfig, SFTOptimConfig  # noqa: F401 (optim's own config names)
from lspo_jax.rl import logprobs, losses

Params = dict[str, Any]
BASE, LORA, POLICY = "base", "lora", "policy"
_LOSS = losses.LossSpec()  # the paper's clip, temperature 1, the LM head unchunked


# -------------------------------------------------------------------------------------- transforms
def adamw_transform(config: AdamWConfig) -> optax.GradientTransformation:
    """``clip_by_global_norm(max_grad_norm)`` then AdamW with the schedule of ``config`` (``lr_schedule``)."""
    schedule = lr_schedule(config)
    adamw = optax.adamw(schedule, b1=config.b1, b2=config.b2, eps=config.eps, weight_decay=config.weight_decay)
    if config.max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), adamw)


def learning_rate(config: AdamWConfig, count: int) -> float:
    """The rate of ``config``'s schedule at the update that follows ``count`` applied ones."""
    return float(lr_schedule(config)(count))


# The decay after the warm-up: the progress p in [0, 1] and the floor m (``min_lr_ratio``) -> lr's factor, 1 at p = 0.
LR_SCHEDULES = options.Registry(options.LRSchedule, "learning-rate schedule")


@LR_SCHEDULES.register("constant")
def constant_decay(progress: jax.Array, floor: float) -> float:
    return 1.0


@LR_SCHEDULES.register("cosine")
def cosine_decay(progress: jax.Array, floor: float) -> jax.Array:
    """``m + (1 - m) (1 + cos(pi p)) / 2``: 1 at p = 0, ``(1 + m) / 2`` midway, m at p = 1."""
    return floor + (1.0 - floor) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))


@LR_SCHEDULES.register("linear")
def linear_decay(progress: jax.Array, floor: float) -> jax.Array:
    """``1 - (1 - m) p``: a straight line from 1 to m."""
    return 1.0 - (1.0 - floor) * progress


def lr_schedule(config: AdamWConfig) -> optax.Schedule:
    """``config``'s rate as a function of the updates applied: the linear warm-up, then its ``schedule``'s decay over
    ``decay_steps`` (see ``AdamWConfig``); the optimizer and ``learning_rate`` both read it."""
    decay = LR_SCHEDULES.resolve(config.schedule)
    if decay is constant_decay:  # the warm-up alone, as before there were schedules: the same program
        return _warmup_schedule(config.lr, config.warmup_steps)
    if config.decay_steps is None:
        raise ValueError(f"a {config.schedule} schedule needs decay_steps: a run's config sets null to the optimizer's "
                         "lifetime (AdamWConfig.lasting)")  # fmt: skip
    lr, warmup, floor = config.lr, config.warmup_steps, config.min_lr_ratio
    span, warm = max(1, config.decay_steps - warmup), _warmup_schedule(1.0, warmup)

    def schedule(count: jax.Array) -> jax.Array:
        progress = jnp.clip((count - warmup) / span, 0.0, 1.0)  # 0 through the warm-up: the decay's factor is 1
        return lr * warm(count) * decay(progress, floor)

    return schedule


def _warmup_schedule(lr: float, warmup_steps: int) -> optax.Schedule:
    if warmup_steps == 0:
        return optax.constant_schedule(lr)

    def schedule(count: jax.Array) -> jax.Array:
        return lr * jnp.minimum(1.0, (count + 1) / warmup_steps)

    return schedule


def param_labels(params: Params) -> Params:
    """Label every leaf with its top-level key, ``"base"``, ``"lora"`` or ``"policy"`` (the ``multi_transform``
    labels)."""
    unknown = set(params) - {BASE, LORA, POLICY}
    if unknown:
        raise ValueError(f"params may only hold 'base', 'lora' and 'policy' subtrees, got extra {sorted(unknown)}")
    return {label: _fill(subtree, label) for label, subtree in params.items()}


def _fill(tree: Any, value: str) -> Any:
    return jax.tree.map(lambda _: value, tree)


def make_optimizer(
    rl: RLOptimConfig = RLOptimConfig(), sft: SFTOptimConfig = SFTOptimConfig()
) -> optax.GradientTransformation:
    """``multi_transform({"base": AdamW(rl), "lora": AdamW(sft)}, param_labels)``; with ``rl.train: lora``,
    ``{"base": set_to_zero, "policy": AdamW(rl), "lora": AdamW(sft)}`` (a frozen base, no state for it).

    Initialise it on the full ``{"base", "lora"}`` params (``"policy"`` too for LoRA RL); step it with
    ``rl_step``/``sft_step`` (or ``update_subtree``), never with its own ``update`` (see the module docstring).
    """
    if rl_subtree(rl) == POLICY:
        transforms = {BASE: optax.set_to_zero(), POLICY: adamw_transform(rl), LORA: adamw_transform(sft)}
        return optax.multi_transform(transforms, param_labels)
    return optax.multi_transform({BASE: adamw_transform(rl), LORA: adamw_transform(sft)}, param_labels)


def rl_subtree(rl: RLOptimConfig) -> str:
    """The subtree the RL update trains: ``"base"`` (``optim.train: full``) or ``"policy"`` (``lora``)."""
    return POLICY if rl.train == "lora" else BASE


def policy_keys(params: Params) -> tuple[str, ...]:
    """The subtrees of ``params`` that make the policy: the base, and the policy adapter where there is one."""
    return tuple(k for k in (BASE, POLICY) if k in params)


def direct_optimizer(rl: RLOptimConfig, sft: SFTOptimConfig) -> optax.GradientTransformation:
    """The direct-supervision control's optimizer (``scaffold.supervise: base``): ``make_optimizer``'s with the
    base's AdamW at its peak rate (``rl`` without warm-up or decay), initialised fresh every step as the adapter's
    is."""
    return make_optimizer(_peak(rl), sft)


def _peak(rl: RLOptimConfig) -> RLOptimConfig:
    return dataclasses.replace(rl, warmup_steps=0, schedule="constant")


def update_subtree(
    tx: optax.GradientTransformation,
    label: str,
    grads: Any,
    params: Params,
    opt_state: optax.MultiTransformState,
) -> tuple[Params, optax.MultiTransformState]:
    """Apply ``tx`` (the inner transform of ``label``) to ``params[label]`` with ``grads`` for that subtree.

    Runs ``optax.masked(tx, label mask)`` on the label's state exactly as ``multi_transform`` would; the other
    subtree's parameters and optimizer state are returned as they came in (bit-identical).
    """
    mask = jax.tree.map(lambda leaf_label: leaf_label == label, param_labels(params))
    # masked() passes the other subtree's "updates" through untouched; they are discarded below.
    full_grads = {key: grads if key == label else jax.tree.map(jnp.zeros_like, sub) for key, sub in params.items()}
    updates, label_state = optax.masked(tx, mask).update(full_grads, opt_state.inner_states[label], params)
    new_params = dict(params)
    new_params[label] = optax.apply_updates(params[label], updates[label])
    inner_states = dict(opt_state.inner_states)
    inner_states[label] = label_state
    return new_params, opt_state._replace(inner_states=inner_states)


# ------------------------------------------------------------------------------------------- steps
def rl_step(
    config: ModelConfig,
    params: Params,
    opt_state: optax.MultiTransformState,
    batch: Mapping[str, jax.Array],
    *,
    rl: RLOptimConfig = RLOptimConfig(),
    spec: losses.LossSpec = _LOSS,
    num_micro_batches: int = 1,
) -> tuple[Params, optax.MultiTransformState, losses.Metrics]:
    """One RL update of the policy (``rl_subtree``: the base, or the policy adapter of LoRA RL): ``policy_loss``
    token-mean over the whole batch (plus ``spec``'s ``losses.policy_regularizers``: KL to the reference, entropy
    bonus), the scaffold's adapter off.

    ``spec``: the clip, temperature, LM-head chunk and regularizers (``losses.LossSpec``); ``num_micro_batches``
    accumulates the gradient over that many groups of rows (``losses.accumulate_gradients``).

    ``batch``: ``tokens``, ``mask`` (response tokens) and ``old_logp`` (and ``ref_logp``, the reference's log-probs,
    where ``spec.kl_coef`` > 0), all ``[B, T]`` and aligned as in ``logprobs.sequence_logprobs``, ``advantages``
    ``[B]`` or ``[B, T]``, and the rows' layout: ``attention_mask``
    (left-padded rows) or ``segment_ids`` and ``positions`` (packed rows, ``packing.pack_rows``). The forward pass
    gets only ``params["base"]`` with ``lora_scale = 0``, so the adapter is neither computed nor differentiated.
    ``spec.chunk_size`` runs the LM head in sequence chunks (see ``logprobs.sequence_logprobs``).
    Jittable with ``config`` and the keyword arguments static.
    """
    trained = rl_subtree(rl)
    frozen = {BASE: params[BASE]} if trained == POLICY else None
    with jax.named_scope("rl_grad"):
        loss, grads, metrics = rl_gradients(
            config, params[trained], batch, spec=spec, num_micro_batches=num_micro_batches, frozen=frozen
        )
    with jax.named_scope("rl_update"):
        params, opt_state = update_subtree(adamw_transform(rl), trained, grads, params, opt_state)
    return params, opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads), **metrics}


def rl_gradients(
    config: ModelConfig,
    base: Params,
    batch: Mapping[str, jax.Array],
    *,
    spec: losses.LossSpec = _LOSS,
    num_micro_batches: int = 1,
    frozen: Params | None = None,
) -> tuple[jax.Array, Params, losses.Metrics]:
    """``rl_step``'s ``(loss, gradient w.r.t. the base, metrics)`` before the optimizer: ``batch`` as there.
    ``frozen`` (LoRA RL: ``{"base": ...}``): ``base`` is then the policy adapter, differentiated, and the frozen
    subtrees enter the forward as constants."""

    def loss_fn(trained: Params, micro: Mapping[str, jax.Array], num_tokens: jax.Array):
        policy = {BASE: trained} if frozen is None else {**frozen, POLICY: trained}
        # The entropy is differentiated only for a bonus that reads it: the default program stays the metric's.
        logp, entropy = logprobs.logprobs_and_entropy(
            config, policy, micro["tokens"], **logprobs.layout(micro), **spec.reading,
            entropy_grad=bool(spec.entropy_coef),
        )  # fmt: skip
        loss, metrics = losses.policy_loss(
            logp, micro["old_logp"], micro["advantages"], micro["mask"], num_tokens=num_tokens, **spec.clip
        )
        metrics["entropy"] = losses.masked_mean(entropy, micro["mask"])  # aux: never differentiated
        if spec.regularized:
            term, extra = losses.policy_regularizers(
                logp, micro["mask"], ref_logp=micro.get("ref_logp"), entropy=entropy, num_tokens=num_tokens,
                **spec.regularizers,
            )  # fmt: skip
            loss, metrics = loss + term, {**metrics, **extra}
        return loss, metrics

    return losses.accumulate_gradients(loss_fn, base, batch, num_micro_batches)


def keep_if_finite(step: Callable, loss: str = "loss", norm: str = "grad_norm", subtree: str = BASE) -> Callable:
    """``step(params, opt_state, batch) -> (params, opt_state, metrics)`` that returns params and optimizer state
    as they came in when the loss, the gradient norm, or any updated value of ``params[subtree]`` or of its optimizer
    state is non-finite, and says which in ``metrics["finite"]``: one bad batch skips its update whole (the
    optimizer's count included) instead of poisoning the weights.

    The updated values count because a finite loss and gradient can still write NaN: a NaN or infinity already in
    AdamW's moments (a damaged checkpoint restored) makes ``m / (sqrt(v) + eps)`` non-finite. Only ``subtree`` is
    checked: the step updates it alone, and the other subtree (a diverged scratch adapter) is returned as it came.
    """

    @functools.wraps(step)
    def guarded(params: Params, opt_state: Any, batch: Mapping[str, jax.Array]):
        new_params, new_state, metrics = step(params, opt_state, batch)
        updated = (new_params[subtree], new_state.inner_states[subtree])
        finite = jnp.isfinite(metrics[loss]) & jnp.isfinite(metrics[norm]) & _all_finite(updated)
        # Only the updated subtree is selected: the others come back as they went in (a frozen bf16 base of LoRA RL
        # is not read and written once more per step).
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
        params = {**new_params, subtree: keep(new_params[subtree], params[subtree])}
        states = new_state.inner_states
        inner = {**states, subtree: keep(states[subtree], opt_state.inner_states[subtree])}
        return params, new_state._replace(inner_states=inner), {**metrics, "finite": finite}

    return guarded


def _all_finite(tree: Any) -> jax.Array:
    """True when every floating-point value in ``tree`` is finite (integer leaves, the optimizer's counts, always
    are): one reduction per leaf, inside the step's jitted program, combined into one flag."""
    floats = [leaf for leaf in jax.tree.leaves(tree) if jnp.issubdtype(leaf.dtype, jnp.inexact)]
    return functools.reduce(jnp.logical_and, [jnp.all(jnp.isfinite(leaf)) for leaf in floats], jnp.bool_(True))


def sft_step(
    config: ModelConfig,
    params: Params,
    opt_state: optax.MultiTransformState,
    batch: Mapping[str, jax.Array],
    *,
    sft: SFTOptimConfig = SFTOptimConfig(),
    num_micro_batches: int = 1,
    chunk_size: int | None = None,
) -> tuple[Params, optax.MultiTransformState, losses.Metrics]:
    """One SFT update of the adapter: token-mean cross-entropy with the adapter on (``lora_scale = 1``).

    ``batch``: ``tokens`` and ``mask`` (solution tokens; prompt and padding False), ``[B, T]``, aligned as in
    ``logprobs.sequence_logprobs``, and a layout as in ``rl_step``. Only ``params["lora"]`` is differentiated and
    updated; the base enters the forward as a constant. Temperature 1: the adapter fits the data distribution.
    ``chunk_size`` as in ``rl_step``.
    """
    return _sft_update(config, params, opt_state, batch, adamw_transform(sft), LORA, num_micro_batches, chunk_size)


def _sft_update(config, params, opt_state, batch, tx, subtree, num_micro_batches, chunk_size):
    """The SFT loss's gradient w.r.t. ``subtree`` (``sft_gradients``) applied by ``tx`` to that subtree alone."""
    with jax.named_scope("sft_grad"):
        loss, grads, metrics = sft_gradients(
            config, params, batch, num_micro_batches=num_micro_batches, chunk_size=chunk_size, subtree=subtree
        )
    with jax.named_scope("sft_update"):
        params, opt_state = update_subtree(tx, subtree, grads, params, opt_state)
    return params, opt_state, {"sft_loss": loss, "sft_grad_norm": optax.tree.norm(grads), **metrics}


def sft_gradients(
    config: ModelConfig,
    params: Params,
    batch: Mapping[str, jax.Array],
    *,
    num_micro_batches: int = 1,
    chunk_size: int | None = None,
    subtree: str = LORA,
    token_weight: str | Callable | None = None,
) -> tuple[jax.Array, Params, losses.Metrics]:
    """``sft_step``'s ``(loss, gradient w.r.t. the adapter, metrics)`` before the optimizer: ``batch`` as there.
    ``subtree=BASE``: the gradient w.r.t. the base with the adapter off (the direct-supervision control's).
    ``token_weight``: per-token weights of the loss (``losses.weighted_sft_loss``); None: ``losses.sft_loss``."""

    # The scaffold's adapter stacks on the policy: base + policy adapter (LoRA RL) + the adapter being fitted.
    policy = {k: params[k] for k in policy_keys(params)}

    def loss_fn(trained: Params, micro: Mapping[str, jax.Array], num_tokens: jax.Array):
        full, scale = ({BASE: trained}, 0.0) if subtree == BASE else ({**policy, LORA: trained}, 1.0)
        logp, _ = logprobs.sequence_logprobs(
            config, full, micro["tokens"], **logprobs.layout(micro), lora_scale=scale, chunk_size=chunk_size
        )
        if token_weight is None:
            loss = losses.sft_loss(logp, micro["mask"], num_tokens=num_tokens)
        else:
            loss = losses.weighted_sft_loss(logp, micro["mask"], token_weight=token_weight, num_tokens=num_tokens)
        return loss, {"num_tokens": jnp.sum(micro["mask"].astype(jnp.float32))}

    return losses.accumulate_gradients(loss_fn, params[subtree], batch, num_micro_batches)


def base_sft_step(
    config: ModelConfig,
    params: Params,
    opt_state: optax.MultiTransformState,
    batch: Mapping[str, jax.Array],
    *,
    rl: RLOptimConfig = RLOptimConfig(),
    num_micro_batches: int = 1,
    chunk_size: int | None = None,
) -> tuple[Params, optax.MultiTransformState, losses.Metrics]:
    """One SFT update of the base, adapter off: ``sft_step``'s loss and batch, ``direct_optimizer``'s state."""
    tx = adamw_transform(_peak(rl))
    return _sft_update(config, params, opt_state, batch, tx, BASE, num_micro_batches, chunk_size)


def mixed_rl_step(
    config: ModelConfig,
    params: Params,
    opt_state: optax.MultiTransformState,
    batch: Mapping[str, Any],
    *,
    rl: RLOptimConfig = RLOptimConfig(),
    spec: losses.LossSpec = _LOSS,
    num_micro_batches: int = 1,
    sft_micro_batches: int = 1,
    token_weight: str | Callable = "none",
) -> tuple[Params, optax.MultiTransformState, losses.Metrics]:
    """One update of the base on the mixed objective ``L_RL + mu * L_SFT`` (``losses.mixed_loss``), adapter off.

    ``batch``: ``{"rl": rl_step's batch, "sft": sft_step's batch, "mu": scalar}``. The gradient of the sum is
    ``grad L_RL + mu * grad L_SFT``: each term is accumulated over its own rows (``rl_gradients``, ``sft_gradients``
    with ``token_weight``), each a token-mean over its own batch's tokens, then summed, and the RL optimizer takes
    one step on it (its clip on the sum's norm, its count advanced once). The SFT log-probs are at temperature 1
    (the data's distribution), the RL ones at ``spec``'s. Metrics: ``rl_step``'s (``loss`` is L_RL, ``grad_norm``
    the sum's) and ``mix_sft_loss`` (L_SFT).
    """
    base = params[BASE]
    with jax.named_scope("rl_grad"):
        loss, grads, metrics = rl_gradients(config, base, batch["rl"], spec=spec, num_micro_batches=num_micro_batches)
    with jax.named_scope("sft_grad"):
        sft_loss, sft_grads, _ = sft_gradients(
            config, params, batch["sft"], num_micro_batches=sft_micro_batches, chunk_size=spec.chunk_size,
            subtree=BASE, token_weight=token_weight,
        )  # fmt: skip
    mu = jnp.asarray(batch["mu"], jnp.float32)
    grads = jax.tree.map(lambda g, s: (g.astype(jnp.float32) + mu * s.astype(jnp.float32)).astype(g.dtype), grads,
                         sft_grads)  # fmt: skip
    with jax.named_scope("rl_update"):
        params, opt_state = update_subtree(adamw_transform(rl), BASE, grads, params, opt_state)
    return params, opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads), **metrics, "mix_sft_loss": sft_loss}


# ------------------------------------------------------------------------------------------- reset
def reset_adapter(
    config: ModelConfig,
    params: Params,
    opt_state: optax.MultiTransformState,
    key: jax.Array,
    *,
    sft: SFTOptimConfig = SFTOptimConfig(),
) -> tuple[Params, optax.MultiTransformState]:
    """A fresh adapter (``specs.init_lora``: A random, B = 0) and a fresh SFT optimizer state.

    The base params and the RL optimizer state are returned untouched. ``sft`` must be the config the
    optimizer was made with; a state of a different structure is an error rather than a silent mismatch.
    """
    new_params = {**params, LORA: specs.init_lora(config, key)}
    mask = jax.tree.map(lambda leaf_label: leaf_label == LORA, param_labels(new_params))
    fresh = optax.masked(adamw_transform(sft), mask).init(new_params)
    old = opt_state.inner_states[LORA]
    if jax.tree.structure(fresh) != jax.tree.structure(old):
        raise ValueError("the SFT optimizer state does not match SFTOptimConfig; pass the config used at init")
    inner_states = {**opt_state.inner_states, LORA: fresh}
    return new_params, opt_state._replace(inner_states=inner_states)
