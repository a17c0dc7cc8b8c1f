"""The learner: one object per run that owns what a training step acts on, with the step's verbs as methods.

Built once per run: the policy (model config, tokenizer, EOS ids), the device mesh (one device is a 1 x 1 x 1
mesh, so every pass has one program), the compiled programs (``distributed``) and the train state, from the
config; and the verifier, the token-advantages strategy and the vLLM engine, which the run builds and gives it.
``train.train_step`` is written in its verbs:

    sample       rollouts of prompts from the base (``lora_scale`` 0) or with the adapter on, packed into rows
    score        the correctness signal (0/1) and the shaped reward of packed rows (``reward.functions``)
    logprobs     teacher-forced log-probs of rows at the sampling temperature (the old-log-prob passes)
    reset_adapter / sft_step   a fresh adapter and its optimizer state / one adapter-only SFT update
    rl_step      one update of the policy (the base, or LoRA RL's policy adapter), skipped whole when non-finite
                 (``mixed_rl_step``: with an SFT term)
    base_sft_steps / base_sft_updates   SFT updates of the base itself (the direct control; the SFT warm-up)

With ``rollout.engine: vllm`` every rollout is sampled by the engine, which syncs the params it is given
first: ``sample`` is also the weight sync. In a job of several processes each process has its own engine, and every
call samples a block of the prompts on each (``vllm_sampler.prompt_share``), gathered back in prompt order on every
process; ``engine_record`` says how many engines there are and how many prompts the busiest sampled in the step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from safetensors import SafetensorError

from lspo_jax import options
from lspo_jax.models import attention, hf, sharding, specs
from lspo_jax.models.specs import Params
from lspo_jax.rl import checkpoint, corrections, distributed, losses, optim, packing, scaffold
from lspo_jax.rl.checkpoint import TrainState
from lspo_jax.rl.packing import Arrays, Rows
from lspo_jax.rollout.generator import Generator, Policy
from lspo_jax.tasks import reward_functions, rewards
from lspo_jax.train_config import TrainConfig


@dataclasses.dataclass(frozen=True)
class SFTTerm:
    """The SFT term of the mixed objective's update (``scaffold.supervise: mixed``): ``mu`` times the SFT loss of
    ``batch`` (``packing.pack_sft`` rows: the cliffs' prompts and worked solutions)."""

    batch: Arrays
    mu: float


@dataclasses.dataclass(frozen=True)
class Placed:
    """A pass's input on the mesh: ``arrays`` (``tokens``, a layout, the pass's keys), the ``micro_batches`` they
    split into, and for packed rows the ``packing.Packed`` they came from."""

    arrays: dict[str, jax.Array]
    micro_batches: int
    packed: packing.Packed | None = None

    def unpack(self, result: np.ndarray) -> np.ndarray:
        """A per-token result of the pass in the source rows' layout (padded rows: as it is)."""
        return result if self.packed is None else self.packed.unpack(result)


class Learner:
    """A run's policy, mesh, programs, verifier, engine and train state (see the module docstring), given whole.

    ``verifier``: anything with ``score(responses, golds) -> array`` and ``close()`` (and ``score_function``, to run
    the reward functions in its workers: ``verify_pool.VerifierPool``'s). ``engine``: a function
    starting the run's vLLM engine (``rollout.engine: vllm``; ``vllm`` is the engine it started).
    ``token_advantages``: the step's strategy for per-token advantages (``train.TokenAdvantages``), None for
    GRPO's per-row ones. Without a verifier the learner can sample and train but not ``score``.
    """

    def __init__(
        self, run: TrainConfig, policy: Policy, base: Params, *, mesh: Mesh | None = None, verifier: Any = None,
        token_advantages: Any = None, resume: Callable[[TrainState, bool], TrainState] | None = None,
        engine: Callable[[], Any] | None = None,
    ):  # fmt: skip
        """Built complete: ``resume(fresh, adapter)`` maps the fresh train state, placed on the mesh, to the one the
        run continues from (a checkpoint's; ``adapter``: whether the adapter lifetime checkpoints the adapter);
        ``engine`` starts the vLLM engine, called last so that nothing in here can fail after it and leave it
        running."""
        self.run, self.policy, self.mesh = run, policy, sharding.mesh_or_local(mesh)
        self.verifier, self.token_advantages = verifier, token_advantages
        # The reward functions over the verifier (``reward.functions``), and their failures so far, by name.
        self.rewards = reward_functions.Rewards.of(verifier, run.reward)
        self.reward_failures: dict[str, int] = {}
        config = policy.config
        # Each strategy option resolved once: the step hands these on, never the names.
        self.estimator = losses.ESTIMATORS.resolve(run.loss.advantage)
        self.splice_variant = scaffold.SPLICE_VARIANTS.resolve(run.scaffold.splice)
        self.correction = corrections.CORRECTIONS.resolve(run.scaffold.correction)
        self.adapter_lifetime = options.ADAPTER_LIFETIMES.resolve(run.scaffold.adapter)
        self.mix_schedule = losses.MIX_SCHEDULES.resolve(run.scaffold.mix_schedule)
        self.sft_token_weight = losses.SFT_TOKEN_WEIGHTS.resolve(run.scaffold.mix_token_weight)
        self.loss_spec = losses.LossSpec.of(run)  # the update's and the log-prob passes'
        self._tx = optim.make_optimizer(run.optim, run.scaffold.sft)
        self._layouts = (
            sharding.param_shardings(config, self.mesh),
            sharding.opt_state_shardings(config, self.mesh, self._tx),
        )
        # The KL penalty's frozen reference (``loss.kl_coef``), copied before the state's base can be donated.
        self.reference = reference_params(run, config, base["base"], self._layouts[0]["base"])
        params = initial_params(run, config, base["base"])
        self.state = TrainState(step=0, params=params, opt_state=self._tx.init(params))
        if "policy" in params:  # a frozen base: its identity, for the checkpoints of the policy adapter alone
            self.state.base_digest = checkpoint.base_digest(base["base"])
        self.state.params, self.state.opt_state = self.place(self.state.params, self.state.opt_state)
        if resume is not None:
            self.state = resume(self.state, self.adapter_lifetime.checkpointed)
        rollout = run.rollout
        self._engine_step = (self.state.step, 0)  # (step, prompts the busiest engine sampled in its rollouts)
        self.generator = Generator(policy, self.mesh, engine and engine(), compact_every=rollout.compact_every)
        self.decoding = self.generator.decoding(
            rollout.max_new_tokens, rollout.temperature, rollout.top_p, rollout.top_k
        )

    @property
    def vllm(self) -> Any:
        return self.generator.vllm

    # ------------------------------------------------------------------------------------------ state
    def place(self, params: Params, opt_state: Any) -> tuple[Params, Any]:
        """Params and optimizer state in the run's layout on its mesh (``sharding``'s rules)."""
        params_sh, state_sh = self._layouts
        return sharding.shard_params(params, params_sh), jax.device_put(opt_state, state_sh)

    def base_params(self) -> Params:
        """The current policy without the scaffold's adapter (``{"base": ...}``, and LoRA RL's ``"policy"`` adapter),
        as a sampler of the policy takes it."""
        return {k: self.state.params[k] for k in optim.policy_keys(self.state.params)}

    def reset_adapter(self, key: jax.Array) -> None:
        """A fresh adapter (A random, B zero) and a fresh SFT optimizer state; base and RL state untouched."""
        state = self.state
        params, opt_state = optim.reset_adapter(
            self.policy.config, state.params, state.opt_state, key, sft=self.run.scaffold.sft
        )
        state.params, state.opt_state = self.place(params, opt_state)
        state.adapter_reset_step = state.step

    def adapter_due(self) -> bool:
        """Whether this step's scaffold starts from a fresh adapter: every step (``scaffold.adapter: fresh``), or for
        a persistent one at its first use and then every ``scaffold.reset_every`` steps."""
        return self.adapter_lifetime.due(self.state.step, self.state.adapter_reset_step, self.run.scaffold.reset_every)

    # -------------------------------------------------------------------------------------- rollouts
    def sample(
        self, prompts: Sequence[Sequence[int]], key, *, lora_scale: float, n: int | None = None,
        temperature: float | None = None, cancel: Callable[[], bool] | None = None,
    ) -> Rows:  # fmt: skip
        """``n`` (default ``group_size``) rollouts per prompt at ``temperature`` (default the rollout's), packed into
        fixed-shape rows, with ``sampler_logp`` (the engine's own log-prob of each sampled token, 0 on prompt
        slots), from the train state's params on the learner's generator. ``cancel``: asked between decode
        segments, True cuts the rows short (``sampler.generate_arrays``), for rows that will be dropped."""
        return self.sample_from(self.state.params, self.generator, prompts, key, lora_scale=lora_scale, n=n,
                                temperature=temperature, cancel=cancel)  # fmt: skip

    def sample_from(
        self, params: Params, generator: Generator, prompts: Sequence[Sequence[int]], key, *, lora_scale: float,
        n: int | None = None, temperature: float | None = None, cancel: Callable[[], bool] | None = None,
    ) -> Rows:  # fmt: skip
        """``sample``'s rows from a snapshot of the weights, ``params``, on ``generator``'s devices: rollouts sampled
        ahead of the update (``rl.staleness``) read a copy of an earlier base that the update cannot donate, on the
        sampler's own devices with a split placement."""
        n = n or self.run.rollout.group_size
        decoding = self.decoding
        if temperature is not None and temperature != decoding.temperature:
            decoding = dataclasses.replace(decoding, temperature=temperature)
        options = dict(key=key, n=n, lora_scale=lora_scale, fallback=False, cancel=cancel)
        sample = generator.generate(params, prompts, decoding, **options)
        if self.vllm is not None:
            step, count = self._engine_step
            count = count if step == self.state.step else 0
            self._engine_step = (self.state.step, count + int(self.vllm.stats["last_engine_prompts"]))
        prompt_slots = self.run.data.max_prompt_tokens
        prompt_part = np.zeros((len(prompts) * sample.n, prompt_slots), np.float32)
        rows = packing.pack_samples(prompts, sample, prompt_slots)
        return rows.replace(sampler_logp=np.concatenate([prompt_part, sample.logprobs], axis=1))

    def engine_record(self) -> dict[str, int]:
        """The rollout engines of the step in progress, for its train record: ``rollout/engines``, the vLLM engines
        sampling the run's rollouts (one per process; 0 with the JAX sampler, whose rows split over every device
        instead), and ``rollout/engine_prompts``, the prompts the busiest engine sampled in the ``sample`` calls of the
        step that sampled last (first rollouts and re-rolls; the same number on every process; before or after its
        update). Validation is not counted."""
        if self.vllm is None:
            return {"rollout/engines": 0, "rollout/engine_prompts": 0}
        return {"rollout/engines": int(self.vllm.stats["engines"]), "rollout/engine_prompts": self._engine_step[1]}

    def decode(self, rows: Arrays) -> list[str]:
        """The response texts of packed rows (special tokens dropped), as the verifier reads them."""
        return packing.decode_responses(self.policy.tokenizer, rows, self.run.data.max_prompt_tokens)

    def score(self, rows: Rows, examples: Sequence[Any], *, per_row: bool = False) -> Rows:
        """``rows`` with ``accuracy`` (0/1: the correctness signal, ``reward_functions.Rewards``), ``reward`` (the
        reward functions' weighed sum + the overlong penalty) and ``reward/<name>``, each reward function's score (for
        the records).

        ``examples`` (``data.Example``s, whose fields the reward functions receive, or gold answer strings) holds one
        per group of ``group_size`` rows, or one per row with ``per_row``.
        """
        run, texts = self.run, self.decode(rows)
        row_examples = list(examples) if per_row else [examples[i // run.rollout.group_size] for i in range(len(texts))]
        scored = self.rewards.score(texts, row_examples)
        for name, count in scored.failed.items():
            self.reward_failures[name] = self.reward_failures.get(name, 0) + count
        penalty = rewards.overlong_penalty(
            rows["lengths"], run.rollout.max_new_tokens, min(run.reward.overlong_buffer, run.rollout.max_new_tokens),
            run.reward.overlong_factor,
        )  # fmt: skip
        terms = {f"reward/{name}": np.asarray(values, np.float32) for name, values in scored.scores.items()}
        return rows.replace(accuracy=scored.correct, reward=scored.reward + penalty, **terms)

    def take_reward_failures(self) -> dict[str, int]:
        """``reward/<name>_failed``: each reward function's failed calls since the last take (a step takes its own)."""
        taken = {f"reward/{f.name}_failed": self.reward_failures.get(f.name, 0) for f in self.rewards.functions}
        self.reward_failures = {}
        return taken

    # -------------------------------------------------------------------------------------- passes
    def rows_per_micro(self, length: int) -> int:
        """Rows of ``length`` slots in one micro-batch of a pass sized by tokens: as many slots as one micro-batch of
        the padded RL step holds (its rows times ``max_prompt_tokens + max_new_tokens``), rounded down to a multiple
        of the data-parallel size (at least one row a device). A pass's memory then never grows with its rows."""
        run, shards = self.run, sharding.batch_shards(self.mesh)
        rl_rows = -(-run.rollout.prompts_per_step * run.rollout.group_size // run.loss.micro_batches)
        slots = rl_rows * (run.data.max_prompt_tokens + run.rollout.max_new_tokens)
        return max(1, slots // length // shards) * shards

    def place_rows(
        self, rows: Arrays, keys: Sequence[str], micro_batches: int | None = None, *, min_rows: int | None = None
    ) -> Placed:
        """``rows``' tokens, layout and ``keys`` on the mesh as a pass takes them (see ``Placed``): the one place a
        pass's layout is decided.

        With ``loss.packing`` their real tokens are packed into buffers of the rows' length (``packing.pack_rows``),
        in micro-batches of ``rows_per_micro`` buffer rows. Padded, the rows go as they are (with ``min_rows``: padded
        to a power-of-two count, at least ``min_rows``, so a varying count reuses a bounded set of programs), in
        ``micro_batches`` micro-batches (None: as many as ``rows_per_micro`` needs, a power of two).
        """
        shards, length = sharding.batch_shards(self.mesh), rows["tokens"].shape[1]
        if not self.run.loss.packing:
            arrays = {k: rows[k] for k in ("tokens", "attention_mask", *keys)}
            if min_rows is not None:
                arrays = packing.pad_rows(arrays, packing.pow2_bucket(max(len(rows["tokens"]), min_rows)))
            micro = micro_batches or packing.pow2_bucket(-(-len(arrays["tokens"]) // self.rows_per_micro(length)))
            return Placed(packing.mesh_rows(self.mesh, arrays, multiple=micro), micro)
        packed = packing.pack_rows(
            rows, keys, length, row_multiple=shards, rows_per_micro=self.rows_per_micro(length),
            one_per_row=not attention.packs_segments(self.policy.config),
        )  # fmt: skip
        return Placed(packing.mesh_rows(self.mesh, packed.arrays), packed.micro_batches, packed)

    def logprobs(
        self, rows: Arrays, *, lora_scale: float, min_rows: int = 1, temperature: float | None = None
    ) -> np.ndarray:
        """``log pi(tokens[t] | tokens[<t])`` at ``temperature`` (default the rollout's), zero off the response mask.

        Packed (``loss.packing``), the buffer rows and micro-batches are ``place_rows``'; padded, the rows are padded
        to a power-of-two count (at least ``min_rows``) in ``loss.micro_batches`` micro-batches. Either way a varying
        number of rows reuses a bounded set of compiled programs. The pass runs like the RL step: micro-batches one
        after another and the LM head in ``loss.chunk_size`` sequence chunks (``logprobs.grouped_logprobs``).
        """
        return self._logprob_pass(rows, lora_scale, min_rows, temperature)[0]

    def logprobs_with_reference(self, rows: Arrays) -> tuple[np.ndarray, np.ndarray]:
        """``(logprobs(rows, lora_scale=0.0), the frozen reference's log-probs of rows)``, both from one program: the
        same buffer rows, micro-batches and temperature (the rollout's), zero off the response mask. Only with a KL
        penalty (``loss.kl_coef`` > 0), which gives the learner its reference."""
        if self.reference is None:
            raise ValueError("no reference policy: loss.kl_coef is 0")
        return self._logprob_pass(rows, 0.0, 1, None, reference=True)

    def _logprob_pass(self, rows, lora_scale, min_rows, temperature, reference=False) -> tuple[np.ndarray, ...]:
        count, spec = len(rows["tokens"]), self.loss_spec
        placed = self.place_rows(rows, (), self.run.loss.micro_batches, min_rows=min_rows)
        spec = dataclasses.replace(spec, temperature=temperature) if temperature else spec
        program = distributed.sharded_logprobs(
            self.policy.config, self.mesh, lora_scale=lora_scale, spec=spec, num_micro_batches=placed.micro_batches,
            reference=reference,
        )  # fmt: skip
        params = {**self.state.params, "ref": self.reference} if reference else self.state.params
        out = program(params, placed.arrays)
        logps = [placed.unpack(sharding.fetch(x))[:count] for x in (out if reference else (out,))]
        return tuple(np.where(rows["mask"] > 0, logp, 0.0).astype(np.float32) for logp in logps)

    def sft_step(self, batch: Arrays) -> dict[str, Any]:
        """One adapter-only SFT update on ``batch`` (``packing.pack_sft`` rows), in micro-batches of at most
        ``rows_per_micro`` rows: the scaffold's activation memory does not grow with the number of cliffs."""
        state = self.state
        placed = self.place_rows(batch, ("mask",))
        program = distributed.sharded_sft_step(
            self.policy.config, self.mesh, rl=self.run.optim, sft=self.run.scaffold.sft,
            num_micro_batches=placed.micro_batches, chunk_size=self.run.loss.chunk_size,
        )  # fmt: skip
        state.params, state.opt_state, metrics = program(state.params, state.opt_state, placed.arrays)
        return {**metrics, "sft_micro_batches": placed.micro_batches}

    def base_sft_steps(self, batch: Arrays, steps: int) -> dict[str, Any]:
        """``steps`` SFT updates of the base on ``batch`` from a fresh AdamW state (the direct-supervision control,
        ``scaffold.supervise: base``); the adapter and the RL optimizer's state are left as they are."""
        state = self.state
        placed = self.place_rows(batch, ("mask",))
        init, program = self._base_sft_programs(placed.micro_batches)
        opt_state = init(state.params)
        for _ in range(steps):  # each step donates the params it is given: the state holds the live ones
            state.params, opt_state, metrics = program(state.params, opt_state, placed.arrays)
        return {**metrics, "sft_micro_batches": placed.micro_batches}

    def base_sft_updates(self, batches: Iterable[Arrays]) -> Iterator[dict[str, Any]]:
        """One SFT update of the base per batch of ``batches`` (``packing.pack_sft`` rows), all from one fresh AdamW
        state (``base_sft_steps``' optimizer), dropped after the last: the SFT warm-up (``scaffold.supervise:
        sft_warmup``). The adapter and the RL optimizer's state are left as they are. Yields each update's metrics
        (``sft_loss``, ``finite``: a non-finite update is skipped whole) on the host."""
        state, opt_state = self.state, None
        for batch in batches:
            placed = self.place_rows(batch, ("mask",))
            init, program = self._base_sft_programs(placed.micro_batches)
            opt_state = init(state.params) if opt_state is None else opt_state  # one tx: every program's state
            state.params, opt_state, metrics = program(state.params, opt_state, placed.arrays)
            yield jax.device_get(metrics)

    def _base_sft_programs(self, micro_batches: int) -> tuple[Callable, Callable]:
        return distributed.sharded_base_sft_step(
            self.policy.config, self.mesh, rl=self.run.optim, sft=self.run.scaffold.sft,
            num_micro_batches=micro_batches, chunk_size=self.run.loss.chunk_size,
        )  # fmt: skip

    def _rl_program(self, micro_batches: int):
        run = self.run
        return distributed.sharded_rl_step(
            self.policy.config, self.mesh, rl=run.optim, sft=run.scaffold.sft, spec=self.loss_spec,
            num_micro_batches=micro_batches, skip_nonfinite=True,
        )  # fmt: skip

    def _mixed_program(self, micro_batches: int, sft_micro_batches: int):
        run = self.run
        return distributed.sharded_mixed_rl_step(
            self.policy.config, self.mesh, rl=run.optim, sft=run.scaffold.sft, spec=self.loss_spec,
            num_micro_batches=micro_batches, sft_micro_batches=sft_micro_batches, token_weight=self.sft_token_weight,
        )  # fmt: skip

    @property
    def loss_keys(self) -> tuple[str, ...]:
        """The per-token keys of an update's batch besides the tokens and layout: ``ref_logp`` too with a KL term in
        the loss (``loss.kl_in: loss``), so the default update's batch, hence its program, is as it was."""
        return ("mask", "old_logp", "advantages", *(("ref_logp",) if self.loss_spec.kl_coef else ()))

    def rl_grad_norm(self, batch: Arrays) -> float:
        """The norm of the RL gradient ``rl_step`` would take on ``batch``, with nothing updated."""
        placed = self.place_rows(batch, self.loss_keys, self.run.loss.micro_batches)
        program = distributed.sharded_rl_grad_norm(
            self.policy.config, self.mesh, spec=self.loss_spec, num_micro_batches=placed.micro_batches
        )
        return float(jax.device_get(program(self.state.params, placed.arrays)))

    def rl_step(self, batch: Arrays, *, ends_step: bool = True) -> dict[str, Any]:
        """One RL update of the base on ``batch``; a non-finite loss or gradient skips it whole (and is counted).
        ``ends_step=False``: an update that is not the step's last (``optim.mini_batches``, ``optim.epochs``).

        Returns the update's metrics with ``lr``, the rate it was taken at (the schedule's count is the updates
        applied so far, a skipped one not included), and ``pad_fraction``: the share of the update's token slots
        that hold no real token.
        """
        return self._base_update(batch, None, ends_step)

    def mixed_rl_step(self, batch: Arrays, term: SFTTerm) -> dict[str, Any]:
        """``rl_step`` on the mixed objective (``scaffold.supervise: mixed``): one update of the base on ``batch``'s
        RL loss plus ``term.mu`` times the SFT loss of ``term.batch`` (``optim.mixed_rl_step``), the step's only
        update. Its metrics add ``mix_sft_loss``."""
        return self._base_update(batch, term, True)

    def _base_update(self, batch: Arrays, term: SFTTerm | None, ends_step: bool) -> dict[str, Any]:
        state = self.state
        lr = optim.learning_rate(self.run.optim, state.updates)
        placed = self.place_rows(batch, self.loss_keys, self.run.loss.micro_batches)
        pad_fraction = 1.0 - float(np.sum(batch["attention_mask"])) / placed.arrays["tokens"].size
        if term is None:
            program, arrays = self._rl_program(placed.micro_batches), placed.arrays
        else:
            sft = self.place_rows(term.batch, ("mask",))
            program = self._mixed_program(placed.micro_batches, sft.micro_batches)
            arrays = {"rl": placed.arrays, "sft": sft.arrays, "mu": np.float32(term.mu)}
        state.params, state.opt_state, metrics = program(state.params, state.opt_state, arrays)
        metrics = jax.device_get(metrics)
        finite = bool(metrics.pop("finite"))
        state.nonfinite_in_row = 0 if finite else state.nonfinite_in_row + 1
        state.nonfinite_total += int(not finite)
        state.updates += int(finite)
        state.step += int(ends_step)
        return {**metrics, "lr": lr, "finite": finite, "pad_fraction": pad_fraction}

    def close(self) -> None:
        """Close the engine, then the verifier (even if the engine's close fails)."""
        try:
            if self.vllm is not None:
                self.vllm.close()
                self.generator.vllm = None
        finally:
            if self.verifier is not None:
                self.verifier.close()


def initial_params(run: TrainConfig, config: Any, base: Params) -> Params:
    """The train state's params: ``base``, the scaffold's adapter and, for LoRA RL (``optim.train: lora``, which
    ``config.policy_lora`` must match), the policy adapter, a no-op at first (B = 0). The scaffold adapter's init key
    is the run's seed: the first step resets it anyway, but its shapes set the state's."""
    key = jax.random.key(run.seed)
    params = {"base": base, "lora": specs.init_lora(config, key)}
    if (config.policy_lora is not None) != (optim.rl_subtree(run.optim) == optim.POLICY):
        raise ValueError("optim.train: lora needs a model config with policy_lora, and only it has one")
    if config.policy_lora is not None:
        params["policy"] = specs.init_lora(config, jax.random.fold_in(key, 1), config.policy_lora)
    return params


# ---------------------------------------------------------------------------------------------- reference
def reference_dtype(config: Any, dtype: Any) -> Any:
    """The dtype a frozen reference's params are held in: bfloat16 where the policy computes in it (the forward casts
    every weight to it, so the log-probs are the same at half the memory of float32 master weights), else ``dtype``,
    the base's own."""
    return jnp.bfloat16 if config.compute_dtype == "bfloat16" else dtype


def reference_params(run: TrainConfig, config: Any, base: Params, shardings: Any) -> Params | None:
    """The KL penalty's frozen reference (``loss.kl_reference``): a copy of ``base``, the policy as the run loaded it
    (a resumed run's too: it is the initial base), or the Hugging Face directory named, which must hold the base's
    architecture; in ``reference_dtype``, laid out by ``shardings`` (the base's). None without a KL penalty."""
    if not run.loss.kl_coef:
        return None
    reference = base if run.loss.kl_reference is None else _load_reference(run.loss.kl_reference, base)
    reference = jax.tree.map(lambda x: jnp.asarray(x).astype(reference_dtype(config, x.dtype)), reference)
    # A copy, never an alias: the update donates the state's base, which on one device may be ``base``'s buffers.
    return jax.device_put(reference, shardings, may_alias=False)


def _load_reference(path: str, base: Params) -> Params:
    try:
        _, params = hf.load_pretrained(path)
    except (OSError, ValueError, SafetensorError) as err:  # missing, damaged, or not a Qwen2-family directory
        first = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise options.ConfigError(f"loss.kl_reference: {first}") from None
    shapes = lambda tree: jax.tree.map(lambda x: tuple(x.shape), tree)
    if shapes(params["base"]) != shapes(base):
        raise options.ConfigError(f"loss.kl_reference: {path} is not of the policy's architecture (its weights' "
                                  "names or shapes differ from model.path's)")  # fmt: skip
    return params["base"]
