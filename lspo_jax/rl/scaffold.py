"""The scaffold's host-side bookkeeping: which groups are cliffs, and splicing re-rollouts into the batch.

A *cliff* is a group whose K rollouts all fail the verifier: its group-normalised advantages are exactly 0,
so GRPO learns nothing from it. LSPO re-rolls each cliff prompt K times with a freshly fitted adapter and
*splices* the passing re-rollouts into the batch (a partial swap):

    for each cliff group g (in increasing g), with failed base slots f_1 < f_2 < ... of g
    and passing re-rollouts p_1 < p_2 < ... of g:   row f_j  <-  re-rollout p_j,  j = 1 .. min(#f, #p)

Failed re-rollouts are dropped; every other row keeps its values. A spliced row carries the re-rollout's fields,
and the training step carries the re-rollouts' adapter-on log-probs ``log pi_theta+phi`` along (``carry``): the
spliced rows' importance-ratio denominators.

That is ``partial``, the paper's (the default). The others (``splice(..., variant=)``, ``scaffold.splice``):

    group        the cliff group's valid slots <- its re-rollouts in order, passing or not (all of them when
                 there are as many re-rollouts as slots): the group becomes an adapter-on sample
    keep_failed  failed slots <- the passing re-rollouts, then the failed ones: the off-policy rows the paper
                 says add mass without signal. With 0-success cliffs and K re-rolls it fills the same slots
                 as ``group``, in another order; the two differ when cliffs may hold successes
                 (``find_cliffs(max_successes=m)``), which only ``group`` replaces

``adapter_check`` proves, on a step whose re-rolls an external engine sampled, that it held the merged adapter and
not the base: the tokens of the spliced rows, ``spliced_tokens``, are the ones both the check and the step's
diagnostics read.

This runs in numpy on the host, between sampling and the update: the number of passing re-rollouts is
data-dependent, so a jitted version would need padding to fixed shapes for no gain on arrays this small
(a few hundred rows), and the scaffold's logs need concrete Python numbers anyway.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import numpy as np

from lspo_jax import options

Batch = dict[str, np.ndarray]


def find_cliffs(
    accuracy: np.ndarray, group_size: int, valid: np.ndarray | None = None, *, max_successes: int = 0
) -> np.ndarray:
    """``[N // K]`` bool: True for groups with at most ``max_successes`` passing rows (default 0: zero total
    accuracy, ``sum_{i in g} acc_i == 0``).

    Use verifier accuracy (0/1), not the shaped reward: the overlong penalty can make a failed group's
    rewards unequal, but the group is still a cliff. Rows are grouped consecutively (rows 0..K-1 = group 0).
    ``valid`` (``[N]`` bool) marks the rows of groups smaller than K; a group counts its valid rows only,
    and one without any is no cliff.
    """
    acc_GK = _grouped(np.asarray(accuracy), group_size, "accuracy")
    valid_GK = _valid(valid, acc_GK.shape)
    return (np.sum((acc_GK > 0) & valid_GK, axis=1) <= max_successes) & valid_GK.any(axis=1)


@dataclasses.dataclass(frozen=True)
class SpliceStats:
    """Per-step counts of the scaffold, for comparison with the paper's mechanism figures.

    ``surpass_rate`` (cliff groups with at least one verified re-rollout, over cliff groups; about 43% in
    the paper overall, bimodal per step) and ``reroll_pass_rate`` (passing re-rollouts over all
    re-rollouts; 5.8% in the paper) are None on a step without cliffs.
    """

    num_groups: int
    num_cliffs: int
    num_surpassed: int
    num_rerolls: int
    num_passing_rerolls: int
    num_spliced: int

    @property
    def surpass_rate(self) -> float | None:
        return self.num_surpassed / self.num_cliffs if self.num_cliffs else None

    @property
    def reroll_pass_rate(self) -> float | None:
        return self.num_passing_rerolls / self.num_rerolls if self.num_rerolls else None

    def as_metrics(self, prefix: str = "scaffold/") -> dict[str, float]:
        """Flat dict for a metrics log; the rates are left out (not logged as NaN) on a step without cliffs."""
        metrics = {f"{prefix}{f.name}": float(getattr(self, f.name)) for f in dataclasses.fields(self)}
        for name in ("surpass_rate", "reroll_pass_rate"):
            value = getattr(self, name)
            if value is not None:
                metrics[f"{prefix}{name}"] = value
        return metrics


def splice(
    base: Mapping[str, np.ndarray],
    rerolls: Mapping[str, np.ndarray],
    cliffs: np.ndarray,
    group_size: int,
    valid: np.ndarray | None = None,
    *,
    variant: str | SpliceVariant = "partial",
    reroll_n: int | None = None,
    carry: tuple[str, ...] = (),
) -> tuple[Batch, np.ndarray, SpliceStats]:
    """Replace rows of cliff groups by re-rollouts: by default failed rows by passing re-rollouts (the partial
    swap; ``variant`` names another of ``SPLICE_VARIANTS``, see the module doc).

    Args:
        base: per-row arrays of the sampled batch, rows on axis 0 and grouped consecutively by prompt; must
            hold ``"accuracy"`` ``[N]`` (0/1). Typically also ``tokens`` and ``mask`` ``[N, T]`` and ``reward``
            ``[N]``. Every key of ``base`` is spliced, so ``rerolls`` must hold the same keys.
        rerolls: the re-rollouts of the cliff groups, ``reroll_n`` consecutive rows per cliff group, cliff groups
            in increasing group index (the order of ``np.flatnonzero(cliffs)``).
        cliffs: ``[N // K]`` bool from ``find_cliffs``.
        group_size: K.
        valid: optional ``[N]`` bool, False on padding slots of groups smaller than K: never spliced into.
        variant: ``partial``, ``group`` or ``keep_failed``, or the ``SPLICE_VARIANTS`` entry of one.
        reroll_n: re-rollouts per cliff group (default K).
        carry: fields only the re-rollouts hold (e.g. their adapter-on log-probs): the result holds them too, the
            spliced rows' values and zeros on every other row, at the base's token length.

    Token length: axis 1 of every field with ``ndim >= 2`` is the token axis. A re-roll field shorter than
    its base field is right-padded with zeros (pad token 0, mask 0, log-prob 0: masked out everywhere); a
    longer one is an error, since cutting a verified response could cut off the very answer that passed.
    Sample re-rollouts with the same generation limit as the base rollouts.

    Returns:
        ``(spliced, spliced_rows, stats)``: a new dict with the same keys, shapes and dtypes as ``base`` (and ``carry``)
        (inputs are not modified), ``[N]`` bool marking the replaced rows, and the step's ``SpliceStats``.
    """
    variant_ = SPLICE_VARIANTS.resolve(variant)
    acc_GK, reroll_acc_CK, cliff_ids = _accuracies(base, rerolls, cliffs, group_size, reroll_n or group_size, carry)
    valid_GK = _valid(valid, acc_GK.shape)
    # Slots a re-rollout may fill: the failed ones (``group``: all) of valid slots.
    open_GK = valid_GK if variant_.fills_passing_slots else valid_GK & ~(acc_GK > 0)
    dst, src, num_surpassed = _slot_pairs(open_GK, reroll_acc_CK > 0, cliff_ids, variant_.order)
    spliced = {key: _replace_rows(key, np.asarray(base[key]), np.asarray(rerolls[key]), dst, src) for key in base}
    spliced.update({key: _carried(key, np.asarray(rerolls[key]), base, dst, src) for key in carry})
    spliced_rows = np.zeros(acc_GK.size, dtype=bool)
    spliced_rows[dst] = True
    return spliced, spliced_rows, _splice_stats(acc_GK, reroll_acc_CK, cliff_ids, num_surpassed, dst)


def _accuracies(
    base: Mapping[str, np.ndarray], rerolls: Mapping[str, np.ndarray], cliffs: np.ndarray, group_size: int,
    reroll_n: int, carry: tuple[str, ...],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """``splice``'s inputs checked against each other: the base's accuracy ``[G, K]``, the re-rolls' ``[C,
    reroll_n]`` and the cliff groups' indices ``[C]``; a ``ValueError`` naming the first that does not fit."""
    acc_GK = _grouped(np.asarray(base["accuracy"]), group_size, "base accuracy")
    cliffs = np.asarray(cliffs, dtype=bool)
    if cliffs.shape != acc_GK.shape[:1]:
        raise ValueError(f"cliffs must have one entry per group, shape {acc_GK.shape[:1]}, got {cliffs.shape}")
    cliff_ids = np.flatnonzero(cliffs)
    reroll_acc_CK = _grouped(np.asarray(rerolls["accuracy"]), reroll_n, "reroll accuracy")
    if reroll_acc_CK.shape[0] != cliff_ids.size:
        raise ValueError(
            f"{cliff_ids.size} cliff groups need {cliff_ids.size * reroll_n} re-rollouts, "
            f"got {reroll_acc_CK.shape[0] * reroll_n}"
        )
    if overlap := sorted(set(carry) & set(base)):  # carrying it would zero base's values on unspliced rows
        raise ValueError(f"carry field(s) {overlap} are in base too: only re-roll-only fields are carried")
    missing = sorted(set(base) - set(rerolls))
    if missing:
        raise ValueError(f"rerolls lack field(s) {missing} present in base")
    return acc_GK, reroll_acc_CK, cliff_ids


def _carried(key: str, field: np.ndarray, base: Mapping[str, np.ndarray], dst: np.ndarray, src: np.ndarray):
    """A re-roll-only ``field`` on the base's rows: the spliced rows' values, zeros elsewhere (at the base's token
    length, for a per-token field)."""
    rows = np.asarray(base["accuracy"]).size
    shape = (rows, *field.shape[1:]) if field.ndim < 2 else (rows, _length(base), *field.shape[2:])
    return _replace_rows(key, np.zeros(shape, field.dtype), field, dst, src)


def _splice_stats(acc_GK, reroll_acc_CK, cliff_ids, num_surpassed: int, dst: np.ndarray) -> SpliceStats:
    return SpliceStats(
        num_groups=acc_GK.shape[0],
        num_cliffs=int(cliff_ids.size),
        num_surpassed=num_surpassed,
        num_rerolls=int(reroll_acc_CK.size),
        num_passing_rerolls=int(np.sum(reroll_acc_CK > 0)),
        num_spliced=int(dst.size),
    )


def _slot_pairs(
    open_GK: np.ndarray, reroll_pass_CK: np.ndarray, cliff_ids: np.ndarray, order: Callable[[np.ndarray], np.ndarray]
) -> tuple[np.ndarray, np.ndarray, int]:
    """Row pairs (destination in base, source in rerolls): the j-th source re-roll -> the j-th open slot, the
    sources of each cliff in the variant's ``order``."""
    n = reroll_pass_CK.shape[1]
    k = open_GK.shape[1]
    dst, src, surpassed = [], [], 0
    for c, g in enumerate(cliff_ids):
        slots = g * k + np.flatnonzero(open_GK[g])
        sources = order(reroll_pass_CK[c])
        m = min(slots.size, sources.size)
        dst.append(slots[:m])
        src.append(c * n + sources[:m])
        surpassed += int(reroll_pass_CK[c].any())
    return _concat_index(dst), _concat_index(src), surpassed


@dataclasses.dataclass(frozen=True)
class SpliceVariant:
    """A way a cliff's re-rollouts enter its group (``scaffold.splice``; the module doc): which of the group's valid
    slots are open to them (its failed ones, or with ``fills_passing_slots`` all of them), and ``order``: a
    cliff's re-rollouts, from their pass flags ``[n]``, in the order they fill its open slots."""

    fills_passing_slots: bool
    order: Callable[[np.ndarray], np.ndarray]


def _passing_first(passing: np.ndarray) -> np.ndarray:
    return np.concatenate([np.flatnonzero(passing), np.flatnonzero(~passing)])


SPLICE_VARIANTS = options.Registry(options.Splice, "splice variant")
SPLICE_VARIANTS.register("partial")(SpliceVariant(False, np.flatnonzero))  # the passing re-rollouts only
SPLICE_VARIANTS.register("group")(SpliceVariant(True, lambda passing: np.arange(passing.size)))  # all, in order
SPLICE_VARIANTS.register("keep_failed")(SpliceVariant(False, _passing_first))


def _concat_index(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def _replace_rows(key: str, base: np.ndarray, rerolls: np.ndarray, dst: np.ndarray, src: np.ndarray) -> np.ndarray:
    if base.shape[2:] != rerolls.shape[2:] or base.ndim != rerolls.ndim:
        raise ValueError(f"field {key!r}: base rows {base.shape[1:]} and re-roll rows {rerolls.shape[1:]} differ")
    if not np.can_cast(rerolls.dtype, base.dtype, casting="same_kind"):
        raise ValueError(f"field {key!r}: re-roll dtype {rerolls.dtype} does not fit base dtype {base.dtype}")
    if base.ndim >= 2 and rerolls.shape[1] != base.shape[1]:
        rerolls = _pad_tokens(key, rerolls, base.shape[1])
    out = base.copy()
    out[dst] = rerolls[src]
    return out


def _length(base: Mapping[str, np.ndarray]) -> int:
    """The token length of ``base``'s per-token fields (axis 1 of those with ``ndim >= 2``)."""
    lengths = {np.shape(value)[1] for value in base.values() if np.ndim(value) >= 2}
    if len(lengths) != 1:
        raise ValueError(f"a carried per-token field needs base fields of one token length, found {sorted(lengths)}")
    return lengths.pop()


def _pad_tokens(key: str, x: np.ndarray, length: int) -> np.ndarray:
    if x.shape[1] > length:
        raise ValueError(
            f"field {key!r}: re-rollouts have {x.shape[1]} token positions, the batch only {length}; "
            "truncating could cut off the verified answer, so sample both with the same limit"
        )
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, length - x.shape[1])
    return np.pad(x, pad)


def _valid(valid: np.ndarray | None, shape: tuple[int, int]) -> np.ndarray:
    if valid is None:
        return np.ones(shape, bool)
    valid = np.asarray(valid, bool)
    if valid.size != shape[0] * shape[1]:
        raise ValueError(f"valid must have one entry per row ({shape[0] * shape[1]}), got {valid.shape}")
    return valid.reshape(shape)


def _grouped(values: np.ndarray, group_size: int, name: str) -> np.ndarray:
    if values.ndim != 1:
        raise ValueError(f"{name} must be 1-D [N], got shape {values.shape}")
    if group_size < 1 or values.size % group_size:
        raise ValueError(f"{name}: {values.size} rows is not a multiple of group_size={group_size}")
    return values.reshape(-1, group_size)


# ------------------------------------------------------------------------------------------ the adapter check
def spliced_tokens(values: np.ndarray, token_mask: np.ndarray, spliced_rows: np.ndarray) -> np.ndarray:
    """``[tokens]``: the per-token ``values`` ``[N, T]`` of the spliced rows' response tokens, row by row."""
    spliced_rows = np.asarray(spliced_rows, bool)
    return np.asarray(values)[spliced_rows][np.asarray(token_mask)[spliced_rows] > 0]


ADAPTER_CHECK = ("scaffold/adapter_check", "scaffold/engine_adapter_diff", "scaffold/engine_base_diff")
# The adapter and the base tell apart when they differ on the spliced tokens by this many times the engine's noise,
# measured (``noise``) or at least ``ADAPTER_NOISE_FLOOR`` nats/token. Why 4: per token |e - b| + |e - a| >= |a - b|,
# so an engine that held the adapter, off it by its noise n (d_adapter = n), is at d_base >= |a - b| - n from the
# base, and is taken for the base (d_base < d_adapter) only if |a - b| < 2n: at a separation of 4 times the noise
# measured on the base-sampled rows, only if its noise on the re-rolls is over twice that. The floor keeps the
# rounding of float32 log-softmax (about 1e-5 nats/token between vLLM and the trainer on CPU) and a step whose rows
# were all spliced (no base rows to measure the noise on) from deciding on a separation that small.
ADAPTER_SEPARATION = 4.0
ADAPTER_NOISE_FLOOR = 1e-3


class AdapterNotOnError(options.RolloutError):
    """An external engine sampled the scaffold's re-rolls from the base where the merged adapter was meant: the
    spliced rows would carry none of the adapter's behaviour, and the scaffold would learn nothing from its cliffs."""


def adapter_check(
    engine_logp, adapter_logp, base_logp, token_mask, spliced_rows, noise: float, *, step: int, engine: str = "vllm"
) -> dict[str, float | int | None]:
    """Whether the engine that sampled the re-rolls held the adapter, from the spliced rows' tokens.

    ``d_adapter = mean |engine - adapter|`` and ``d_base = mean |engine - base|`` over the spliced tokens, with
    ``engine_logp`` the engine's log-probs of its sampled tokens, ``adapter_logp`` the trainer's log pi_theta+phi and
    ``base_logp`` its log pi_theta (at the re-rolls' temperature); ``noise``: the engine's own mean |engine - trainer|
    on the rows the base sampled (``logprob_mismatch``). When the adapter is distinguishable from the base,
    ``mean |adapter - base| >= ADAPTER_SEPARATION * max(noise, ADAPTER_NOISE_FLOOR)``, an engine nearer the base
    (``d_base < d_adapter``) raises ``AdapterNotOnError`` naming ``step``; otherwise ``scaffold/adapter_check`` is 1
    (the engine held the adapter), or 0 when the two are too close to tell apart (not decided). None without
    spliced tokens. The two distances are recorded as ``scaffold/engine_adapter_diff`` and
    ``scaffold/engine_base_diff``.
    """
    engine_t, adapter_t, base_t = (
        spliced_tokens(x, token_mask, spliced_rows).astype(np.float64) for x in (engine_logp, adapter_logp, base_logp)
    )
    if not engine_t.size:
        return dict.fromkeys(ADAPTER_CHECK)
    d_adapter, d_base = float(np.mean(np.abs(engine_t - adapter_t))), float(np.mean(np.abs(engine_t - base_t)))
    separation = float(np.mean(np.abs(adapter_t - base_t)))
    distinguishable = separation >= ADAPTER_SEPARATION * max(float(noise), ADAPTER_NOISE_FLOOR)
    if distinguishable and d_base < d_adapter:
        raise AdapterNotOnError(
            f"rollout.engine {engine} sampled the re-rolls of step {step} from the base, not the adapter: its "
            f"log-probs are {d_base:.3g} nats/token from the base's and {d_adapter:.3g} from the adapter's "
            f"(rollout.engine: jax samples them with the trainer's own forward)"
        )
    return dict(zip(ADAPTER_CHECK, (int(distinguishable), d_adapter, d_base), strict=True))
