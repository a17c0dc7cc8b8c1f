"""The learner: one object per run that owns what a training step acts on, with the step's verbs as methods.

Built once per run: the policy (model config, tokenizer, EOS ids), the device mesh (one device is a 1 x 1 x 1
mesh, so every pass has one program), the compiled programs (``distributed``) and the train state, from the
config; the run attaches the verifier, the judge, the L2RR target and the vLLM engine once it has built them.
``train.train_step`` is written in its verbs:

    sample       rollouts of prompts from the base (``lora_scale`` 0) or with the adapter on, packed into rows
    score        the verifier's accuracy and the shaped reward of packed rows
    logprobs     teacher-forced log-probs of rows at the sampling temperature (the old-log-prob passes)
    reset_adapter / sft_step   a fresh adapter and its optimizer state / one adapter-only SFT update
    rl_step      one update of the base, skipped whole when non-finite
    prompt_scores  the L2RR target's directional derivatives of the batch, before the update changes the base

With ``rollout.engine: vllm`` every rollout is sampled by the engine, which syncs the params it is given
first: ``sample`` is also the weight sync.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from lspo_jax import distributed, model, optim, packing, rewards, sharding
from lspo_jax.config import ModelConfig
from lspo_jax.model import Params
from lspo_jax.packing import Rows
from lspo_jax.sampler import Decoding, SampleBatch, generate_arrays
from lspo_jax.train_config import TrainConfig


@dataclasses.dataclass(frozen=True)
class Policy:
    """What a model directory loads as besides its weights: the model config, tokenizer and EOS ids."""

    config: ModelConfig
    tokenizer: Any
    eos_ids: tuple[int, ...]


class Generator:
    """Sampling from a policy: the run's vLLM engine when one is set and its context holds the call, else the JAX
    sampler on ``mesh`` (the first device when None). Evaluation and the training step sample through it."""

    def __init__(self, policy: Policy, mesh: Mesh | None = None, vllm: Any = None):
        self.policy, self.mesh, self.vllm = policy, sharding.mesh_or_local(mesh), vllm

    @property
    def tokenizer(self) -> Any:
        return self.policy.tokenizer

    def decoding(self, max_new_tokens: int, temperature: float, top_p: float, top_k: int) -> Decoding:
        return Decoding(max_new_tokens, temperature, top_p, top_k, self.policy.eos_ids)

    def generate(
        self, params: Params, prompts: Sequence[Sequence[int]], decoding: Decoding, *, key, n: int = 1,
        lora_scale: float = 0.0, fallback: bool = True,
    ) -> SampleBatch:  # fmt: skip
        """``n`` samples per prompt. With ``fallback`` (validation) the JAX sampler takes a call longer than the
        vLLM engine's context; without (rollouts), the engine takes every call and refuses one that is too long."""
        options = dict(key=key, n=n, lora_scale=lora_scale, **decoding.kwargs())
        if self.vllm is not None and not (fallback and self._too_long(prompts, decoding)):
            return self.vllm.generate_arrays(params, prompts, **options)
        return generate_arrays(self.policy.config, params, prompts, mesh=self.mesh, **options)

    def _too_long(self, prompts: Sequence[Sequence[int]], decoding: Decoding) -> bool:
        return max(map(len, prompts)) + decoding.max_new_tokens > self.vllm.max_model_len


@dataclasses.dataclass
class TrainState:
    """Everything a step reads and writes. ``params["lora"]`` is scratch space for the step's adapter."""

    step: int
    params: Params
    opt_state: Any
    nonfinite_in_row: int = 0
    nonfinite_total: int = 0


class Learner:
    """A run's policy, mesh, programs, verifier, engine and train state (see the module docstring).

    ``verifier``: anything with ``score(responses, golds) -> array`` and ``close()``. ``vllm``: the run's vLLM
    engine (``rollout.engine: vllm``). ``judge``: the ``first_mistake.Judge`` of a run with that option.
    ``target``: the L2RR target's scorer (``reweight.TargetScorer``) of a run with ``l2rr.enabled``.
    """

    def __init__(self, run: TrainConfig, policy: Policy, base: Params, *, mesh: Mesh | None = None):
        self.run, self.policy, self.mesh = run, policy, sharding.mesh_or_local(mesh)
        # Attached by the run once it has built them, the engine last (nothing after it can fail and leave it
        # running): the verifier (``score``), the judge, the L2RR target's scorer and the vLLM engine.
        self.verifier, self.judge, self.target = None, None, None
        self.generator = Generator(policy, self.mesh)
        config = policy.config
        self.decoding = self.generator.decoding(
            run.rollout.max_new_tokens, run.rollout.temperature, run.rollout.top_p, run.rollout.top_k
        )
        loss = run.loss
        self._rl = distributed.sharded_rl_step(
            config, self.mesh, rl=run.optim, sft=run.scaffold.sft, eps_low=loss.eps_low, eps_high=loss.eps_high,
            clip_c=loss.clip_c, temperature=run.rollout.temperature, num_micro_batches=loss.micro_batches,
            chunk_size=loss.chunk_size, skip_nonfinite=True,
        )  # fmt: skip
        self._sft = distributed.sharded_sft_step(config, self.mesh, rl=run.optim, sft=run.scaffold.sft)
        self._tx = optim.make_optimizer(run.optim, run.scaffold.sft)
        self._layouts = (
            sharding.param_shardings(config, self.mesh),
            sharding.opt_state_shardings(config, self.mesh, self._tx),
        )
        # The adapter's init key is the run's seed: the first step resets it anyway, but its shapes set the state's.
        params = {"base": base["base"], "lora": model.init_lora(config, jax.random.key(run.seed))}
        self.state = TrainState(step=0, params=params, opt_state=self._tx.init(params))
        self.state.params, self.state.opt_state = self.place(self.state.params, self.state.opt_state)

    @property
    def vllm(self) -> Any:
        return self.generator.vllm

    @vllm.setter
    def vllm(self, engine: Any) -> None:
        self.generator.vllm = engine

    # ------------------------------------------------------------------------------------------ state
    def place(self, params: Params, opt_state: Any) -> tuple[Params, Any]:
        """Params and optimizer state in the run's layout on its mesh (``sharding``'s rules)."""
        params_sh, state_sh = self._layouts
        return sharding.shard_params(params, params_sh), jax.device_put(opt_state, state_sh)

    def reset_adapter(self, key: jax.Array) -> None:
        """A fresh adapter (A random, B zero) and a fresh SFT optimizer state; base and RL state untouched."""
        state = self.state
        params, opt_state = optim.reset_adapter(
            self.policy.config, state.params, state.opt_state, key, sft=self.run.scaffold.sft
        )
        state.params, state.opt_state = self.place(params, opt_state)

    # -------------------------------------------------------------------------------------- rollouts
    def sample(self, prompts: Sequence[Sequence[int]], key, *, lora_scale: float, n: int | None = None) -> Rows:
        """``n`` (default ``group_size``) rollouts per prompt, packed into fixed-shape rows, with ``sampler_logp``
        (the engine's own log-prob of each sampled token, 0 on prompt slots)."""
        n = n or self.run.rollout.group_size
        sample = self.generator.generate(
            self.state.params, prompts, self.decoding, key=key, n=n, lora_scale=lora_scale, fallback=False
        )
        prompt_slots = self.run.data.max_prompt_tokens
        rows = packing.pack_samples(prompts, sample, prompt_slots)
        prompt_part = np.zeros((len(prompts) * sample.n, prompt_slots), np.float32)
        rows["sampler_logp"] = np.concatenate([prompt_part, sample.logprobs], axis=1)
        return rows

    def decode(self, rows: Rows) -> list[str]:
        """The response texts of packed rows (special tokens dropped), as the verifier reads them."""
        return packing.decode_responses(self.policy.tokenizer, rows, self.run.data.max_prompt_tokens)

    def score(self, rows: Rows, golds: Sequence[str], *, per_row: bool = False) -> None:
        """Add ``accuracy`` (0/1, the verifier) and ``reward`` (accuracy + overlong penalty) to ``rows``.

        ``golds`` holds one answer per group of ``group_size`` rows, or one per row with ``per_row``.
        """
        run, texts = self.run, self.decode(rows)
        row_golds = list(golds) if per_row else [golds[i // run.rollout.group_size] for i in range(len(texts))]
        rows["accuracy"] = np.asarray(self.verifier.score(texts, row_golds), np.float32)
        shaped = rewards.shaped_rewards(
            rows["accuracy"], rows["lengths"], max_len=run.rollout.max_new_tokens,
            buffer=min(run.reward.overlong_buffer, run.rollout.max_new_tokens), factor=run.reward.overlong_factor,
        )  # fmt: skip
        rows["reward"] = np.asarray(shaped.reward, np.float32)

    # -------------------------------------------------------------------------------------- passes
    def logprobs(self, rows: Rows, *, lora_scale: float, min_rows: int = 1) -> np.ndarray:
        """``log pi(tokens[t] | tokens[<t])`` at the sampling temperature, zero off the response mask.

        Rows are padded to a power-of-two count (at least ``min_rows``), then to a multiple of the product of the
        micro-batch count and the mesh's data-parallel size, so a varying number of rows reuses compiled programs.
        The pass runs like the RL step: rows in ``loss.micro_batches`` groups one after another and the LM head in
        ``loss.chunk_size`` sequence chunks (``logprobs.grouped_logprobs``).
        """
        count, micro = len(rows["tokens"]), self.run.loss.micro_batches
        padded = packing.pad_rows(
            {k: rows[k] for k in ("tokens", "attention_mask")}, packing.pow2_bucket(max(count, min_rows))
        )
        placed = packing.mesh_rows(self.mesh, padded, multiple=micro)
        program = distributed.sharded_logprobs(
            self.policy.config, self.mesh, lora_scale=lora_scale, temperature=self.run.rollout.temperature,
            chunk_size=self.run.loss.chunk_size, num_micro_batches=micro,
        )  # fmt: skip
        logp = sharding.fetch(program(self.state.params, placed["tokens"], placed["attention_mask"]))
        return np.where(rows["mask"] > 0, logp[:count], 0.0).astype(np.float32)

    def sft_step(self, batch: Rows) -> dict[str, Any]:
        """One adapter-only SFT update on ``batch`` (``packing.pack_sft`` rows)."""
        state = self.state
        placed = packing.mesh_rows(self.mesh, batch)
        state.params, state.opt_state, metrics = self._sft(state.params, state.opt_state, placed)
        return metrics

    def rl_step(self, batch: Rows) -> dict[str, Any]:
        """One RL update of the base on ``batch``; a non-finite loss or gradient skips it whole (and is counted).

        Returns the update's metrics with ``lr``, the rate it was taken at: the schedule's count is the updates
        applied so far, a skipped one not included.
        """
        state = self.state
        lr = optim.learning_rate(self.run.optim, state.step - state.nonfinite_total)
        placed = packing.mesh_rows(self.mesh, batch, multiple=self.run.loss.micro_batches)
        state.params, state.opt_state, metrics = self._rl(state.params, state.opt_state, placed)
        metrics = jax.device_get(metrics)
        finite = bool(metrics.pop("finite"))
        state.nonfinite_in_row = 0 if finite else state.nonfinite_in_row + 1
        state.nonfinite_total += int(not finite)
        state.step += 1
        return {**metrics, "lr": lr, "finite": finite}

    def prompt_scores(self, batch: Rows) -> np.ndarray:
        """``<g_tgt, g_i>`` per prompt of ``batch`` at the current base (``reweight.TargetScorer``)."""
        return self.target.scores(self.state.params, batch)

    def close(self) -> None:
        if self.vllm is not None:
            self.vllm.close()
            self.vllm = None
        if self.verifier is not None:
            self.verifier.close()
