"""L2RR's target side: the directional derivatives ``d_i = <g_tgt, g_i>`` of an RL batch's per-prompt policy losses
along the target loss's gradient, one forward-mode product on the mesh (see ``draws`` for what they drive).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lspo_jax import options
from lspo_jax.config import ModelConfig
from lspo_jax.methods.l2rr import config as l2rr_config
from lspo_jax.methods.l2rr.config import PromptLossNorm, TargetLoss
from lspo_jax.models import sharding
from lspo_jax.rl import distributed, logprobs, losses, optim, packing
from lspo_jax.tasks import benchmarks, data_report
from lspo_jax.train_config import TrainConfig

Params = Any


# --------------------------------------------------------------------------------- directional derivatives
def directional_derivatives(per_prompt_losses: Callable[[Params], jax.Array], params: Params, tangent: Params):
    """``[<grad L_i(params), tangent>]_i`` for every prompt i at once: one ``jax.jvp``, no backward passes.

    ``per_prompt_losses`` maps ``params`` to ``[B]`` losses; ``tangent`` has the structure of ``params`` (cast to
    their dtypes). Jittable.
    """
    tangent = jax.tree.map(lambda t, p: jnp.asarray(t, jnp.result_type(p)), tangent, params)
    _, dots = jax.jvp(per_prompt_losses, (params,), (tangent,))
    return dots


@dataclasses.dataclass(frozen=True)
class PolicyLosses:
    """Per-prompt policy losses ``[P]`` of an RL batch as a function of the base params (adapter off).

    The batch is ``optim.rl_step``'s (``tokens``, ``attention_mask``, ``mask``, ``old_logp`` ``[P * K, T]``,
    ``advantages`` ``[P * K]`` or ``[P * K, T]``), prompt i owning rows ``i * K .. i * K + K - 1`` (padding rows
    masked out). ``normalise``: ``prompt`` divides by the prompt's own token count, ``batch`` by the batch's. ``spec``:
    the clip, temperature and LM-head chunk, as in the update (``losses.LossSpec``).
    ``num_micro_batches`` evaluates that many chunks of prompts one after another (``lax.map``), so forward-mode
    memory is one chunk's. Frozen and hashable, so ``bind`` gives a jit-stable function.
    """

    config: ModelConfig
    group_size: int
    normalise: PromptLossNorm = "prompt"
    spec: losses.LossSpec = losses.LossSpec()
    num_micro_batches: int = 1

    def __post_init__(self) -> None:
        options.check(self, "PolicyLosses")
        if self.group_size < 1 or self.num_micro_batches < 1:
            raise ValueError("PolicyLosses.group_size and num_micro_batches must be positive")

    def __call__(self, base: Params, batch: Mapping[str, jax.Array]) -> jax.Array:
        rows, k = batch["tokens"].shape[0], self.group_size
        if rows % k:
            raise ValueError(f"{rows} rows do not form groups of {k}")
        names = ("tokens", "attention_mask", "mask", "old_logp", "advantages")
        groups = {name: jnp.reshape(batch[name], (rows // k, k, *jnp.shape(batch[name])[1:])) for name in names}
        total = jnp.sum(jnp.asarray(batch["mask"], jnp.float32)) if self.normalise == "batch" else None
        if self.num_micro_batches == 1:
            return self._group_losses(base, groups, total)
        chunks = jax.tree.map(lambda x: logprobs.split_rows(x, self.num_micro_batches), groups)
        return logprobs.merge_rows(jax.lax.map(lambda chunk: self._group_losses(base, chunk, total), chunks))

    def _group_losses(self, base: Params, groups: Mapping[str, jax.Array], total: jax.Array | None) -> jax.Array:
        p, k, t = groups["tokens"].shape
        logp, _ = logprobs.sequence_logprobs(
            self.config,
            {optim.BASE: base},
            groups["tokens"].reshape(p * k, t),
            groups["attention_mask"].reshape(p * k, t),
            **self.spec.reading,
        )

        def one_prompt(logp_KT, old_KT, adv_K, mask_KT):
            return losses.policy_loss(logp_KT, old_KT, adv_K, mask_KT, num_tokens=total, **self.spec.clip)[0]

        return jax.vmap(one_prompt)(logp.reshape(p, k, t), groups["old_logp"], groups["advantages"], groups["mask"])

    def bind(self, batch: Mapping[str, Any]) -> jax.tree_util.Partial:
        """``base -> [P]`` on ``batch``; a pytree whose arrays are traced, so one compile serves every step."""
        return jax.tree_util.Partial(self, batch={k: jnp.asarray(v) for k, v in batch.items()})


def target_row_weights(mask: np.ndarray, kind: str) -> np.ndarray:
    """Per-row weights ``u_r`` that make ``sum_r u_r * NLL_r`` (``NLL_r`` the row's summed token NLL) the target loss.

    ``nll_token_mean``: ``u_r = 1 / (total target tokens)``, ``losses.sft_loss`` over all rows.
    ``nll_example_mean``: ``u_r = 1 / (n_r * R)``, the mean over the R rows holding tokens of each row's own
    token-mean (``n_r`` its token count); rows without tokens weigh 0.
    """
    options.require_choice(TargetLoss, kind, "target loss")
    counts = np.sum(np.asarray(mask) > 0, axis=1).astype(np.float64)
    if kind == "nll_token_mean":
        weights = np.full(len(counts), 1.0 / max(counts.sum(), 1.0))
    else:
        weights = np.where(counts > 0, 1.0 / (np.maximum(counts, 1.0) * max(np.count_nonzero(counts), 1)), 0.0)
    return weights.astype(np.float32)


@functools.partial(jax.jit, static_argnames=("config", "num_micro_batches", "chunk_size"))
def target_gradient(
    config: ModelConfig,
    base: Params,
    rows: Mapping[str, jax.Array],
    *,
    num_micro_batches: int = 1,
    chunk_size: int | None = None,
) -> Params:
    """``g_tgt``: the gradient w.r.t. the base params (adapter off) of ``sum_r weight_r * NLL_r``.

    ``rows``: ``packing.pack_sft`` rows (``tokens``, ``attention_mask``, ``mask`` on the solution tokens) and
    ``weight`` ``[R]`` from ``target_row_weights``. Every target loss kind is this one program: the kind lives
    in the weights, which are data. Temperature 1: the target is the data distribution.
    """

    def loss_fn(base: Params, micro: Mapping[str, jax.Array], num_tokens: jax.Array):
        args = (config, {optim.BASE: base}, micro["tokens"], micro["attention_mask"])
        logp, _ = logprobs.sequence_logprobs(*args, chunk_size=chunk_size)
        # Weights are global, so the micro-batches' weighted sums add up to the whole loss.
        nll_R = -jnp.sum(jnp.where(micro["mask"] > 0, logp, 0.0), axis=1)
        return jnp.sum(micro["weight"] * nll_R), {}

    _, grads, _ = losses.accumulate_gradients(loss_fn, base, rows, num_micro_batches)
    return grads


@functools.cache
def sharded_target_gradient(
    config: ModelConfig, mesh: jax.sharding.Mesh, *, num_micro_batches: int = 1, chunk_size: int | None = None
) -> Callable:
    """``target_gradient`` on ``mesh``: ``(base, rows) -> g_tgt``, laid out as the base (``sharding.param_shardings``).

    Traced under the mesh as ``distributed``'s programs are, so the model's layout constraints apply and a vendor
    attention kernel runs per shard. ``rows`` keep the layout they come in (``TargetSide`` splits them as a batch).
    """
    base_sh = sharding.param_shardings(config, mesh)[optim.BASE]
    grad = functools.partial(target_gradient, config, num_micro_batches=num_micro_batches, chunk_size=chunk_size)
    return jax.jit(distributed.in_mesh(mesh, grad), in_shardings=(base_sh, None), out_shardings=base_sh)


@functools.cache
def sharded_directional_derivatives(config: ModelConfig, mesh: jax.sharding.Mesh) -> Callable:
    """``directional_derivatives`` on ``mesh``: ``(per_prompt_losses, base, tangent) -> [B]``, replicated.

    ``per_prompt_losses`` is a ``jax.tree_util.Partial`` (its arrays keep the layout they come in, its function is
    static: one compile per function); ``base`` and ``tangent`` are laid out as the base.
    """
    base_sh = sharding.param_shardings(config, mesh)[optim.BASE]
    return jax.jit(
        distributed.in_mesh(mesh, directional_derivatives),
        in_shardings=(None, base_sh, base_sh),
        out_shardings=sharding.replicated(mesh),
    )


class TargetSide:
    """The held-out target set. It hands the trainer directional derivatives only, never its prompts.

    ``kind``, ``num_micro_batches``: ``L2RRConfig.target_loss`` and ``target_micro_batches``.
    """

    def __init__(
        self,
        config: ModelConfig,
        rows: Mapping[str, np.ndarray],
        *,
        kind: str = "nll_token_mean",
        num_micro_batches: int = 1,
        chunk_size: int | None = None,
    ):
        if not np.any(np.asarray(rows["mask"]) > 0):
            raise ValueError("the target rows hold no target tokens")
        self._config = config
        weighted = {name: np.asarray(rows[name]) for name in ("tokens", "attention_mask", "mask")}
        weighted["weight"] = target_row_weights(weighted["mask"], kind)
        # Rows of zeros (no tokens, so no loss) fill the last micro-batch.
        self._rows = packing.pad_rows(weighted, -(-len(weighted["mask"]) // num_micro_batches) * num_micro_batches)
        self._placed: dict[jax.sharding.Mesh, dict[str, jax.Array]] = {}  # the rows on each mesh, copied there once
        self._options = {"num_micro_batches": num_micro_batches, "chunk_size": chunk_size}

    @classmethod
    def from_examples(
        cls,
        config: ModelConfig,
        examples: Sequence[Any],
        prompt_slots: int,
        solution_slots: int,
        **options: Any,
    ) -> TargetSide:
        """Target rows from ``data.Example``s with worked solutions (``packing.pack_sft``); the others are left out.

        ``prompt_slots`` and ``solution_slots`` are the most a row may take; rows are as long as the examples need
        (``packing.sft_slots``), since every step's target gradient runs over them.
        """
        solved = [ex for ex in examples if ex.solution_ids is not None]
        if not solved:
            raise ValueError("no target example has a worked solution")
        prompts, solutions = [ex.prompt_ids for ex in solved], [ex.solution_ids for ex in solved]
        slots = packing.sft_slots(prompts, solutions, prompt_slots, solution_slots)
        rows = packing.pack_sft(prompts, solutions, *slots)
        return cls(config, rows, **options)

    def directional_derivatives(
        self, params: Params, per_prompt_losses_fn: Callable[[Params], jax.Array], target_params: Params | None = None,
        check: Callable[[], None] | None = None,
    ) -> np.ndarray:  # fmt: skip
        """``<g_tgt, g_i>`` ``[B]`` at ``params`` (``{"base", ...}``; the adapter is ignored), with ``g_tgt`` taken at
        ``target_params`` when given (the look-ahead: the base after the step's update, ``l2rr.lookahead``).

        ``per_prompt_losses_fn`` maps the base params to ``[B]`` losses, e.g. ``PolicyLosses(...).bind(batch)``;
        a ``jax.tree_util.Partial`` of a hashable function compiles once for all steps, any other callable
        once per callable. Both programs run on the mesh the params are laid out on (``distributed.mesh_of``), the
        target rows split over its data axes. ``check`` is called between the two (it may raise to end the scoring
        there: a stop, ``phases.Phases.within``).
        """
        base = params[optim.BASE]
        at = base if target_params is None else target_params[optim.BASE]
        mesh = distributed.mesh_of(base)
        if mesh not in self._placed:  # the same target rows every step: one host-to-device copy, not one a step
            self._placed[mesh] = sharding.global_batch(mesh, self._rows)
        rows = self._placed[mesh]
        tangent = sharded_target_gradient(self._config, mesh, **self._options)(at, rows)
        if check is not None:
            # Waited for first: dispatch returns at once, and the flag read then would come before the work it ends.
            jax.block_until_ready(tangent)
            check()
        fn = per_prompt_losses_fn
        if not isinstance(fn, jax.tree_util.Partial):
            fn = jax.tree_util.Partial(fn)
        return np.asarray(sharded_directional_derivatives(self._config, mesh)(fn, base, tangent))


# The scores are a forward-mode product (jax.jvp), and cuDNN's attention, the blocked one and the Pallas and splash
# kernels are custom_vjp functions, which jvp refuses: each is replaced by the written-out function of the same
# rows that has both rules. cuDNN's by ``xla`` (jax.nn.dot_product_attention's own einsums, one sequence a row);
# the segment-id ones by ``einsum``, which takes the padded rows as they come (``xla`` would rotate every row to
# right padding and back, and hold the same scores). Neither keeps memory O(T x block): a layer holds
# [rows, H, T, T] float32 scores and their tangents, so at long rows ``l2rr.score_micro_batches`` bounds the rows.
FORWARD_MODE_ATTENTION = {"cudnn": "xla", "blocked": "einsum", "pallas": "einsum", "splash": "einsum"}


class TargetScorer:
    """``<g_tgt, g_i>`` of every prompt of an RL batch: the target side's directional derivatives of the batch's
    per-prompt policy losses (``PolicyLosses``, with the run's ``losses.LossSpec``, the update's), on the mesh
    of the params they are taken at."""

    def __init__(self, run: TrainConfig, config: Any, target: TargetSide):
        attention = FORWARD_MODE_ATTENTION.get(config.attention, config.attention)
        config = dataclasses.replace(config, attention=attention)
        self.target = target
        self.losses = PolicyLosses(
            config, run.rollout.group_size, normalise=run.l2rr.prompt_loss_norm, spec=losses.LossSpec.of(run),
            num_micro_batches=l2rr_config.score_micro_batches(run),
        )  # fmt: skip

    def scores(self, params: Any, batch: dict, target_params: Any = None, check=None) -> np.ndarray:
        rows = sharding.global_batch(distributed.mesh_of(params["base"]), batch)  # split over the data axes
        return self.target.directional_derivatives(params, self.losses.bind(rows), target_params, check)


def load_target(run: TrainConfig, config: Any, load_examples) -> TargetScorer:
    """The scorer of ``l2rr.target`` (its first ``target_limit`` examples with worked solutions)."""
    path = benchmarks.benchmark_path(run.l2rr.target, run.eval.data_dir)
    examples, report = load_examples(path)
    solved = [ex for ex in examples if ex.solution_ids is not None][: run.l2rr.target_limit]
    if not solved:  # a start-up error naming the file and what loading dropped, not a traceback from l2rr
        lost = report.losses()
        raise data_report.DataError(
            f"l2rr.target {path}: no example with a worked solution" + (f"; {lost}" if lost else "")
        )
    target = TargetSide.from_examples(
        config, solved, run.data.max_prompt_tokens, run.data.max_solution_tokens,
        kind=run.l2rr.target_loss, num_micro_batches=l2rr_config.target_micro_batches(run, len(solved)),
        chunk_size=run.loss.chunk_size,
    )  # fmt: skip
    return TargetScorer(run, config, target)
