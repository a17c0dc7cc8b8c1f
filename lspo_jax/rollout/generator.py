"""Sampling from a policy through one call, whatever samples: the JAX sampler on the mesh's devices or the run's
vLLM engine. ``Policy`` is what a model directory loads as besides its weights; ``Generator`` samples from it, for
evaluation and for the training step alike."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from jax.sharding import Mesh

from lspo_jax.config import ModelConfig
from lspo_jax.models import sharding
from lspo_jax.models.specs import Params
from lspo_jax.rollout.sampler import generate_arrays
from lspo_jax.rollout.samples import Decoding, SampleBatch


@dataclasses.dataclass(frozen=True)
class Policy:
    """What a model directory loads as besides its weights: the model config, tokenizer and EOS ids."""

    config: ModelConfig
    tokenizer: Any
    eos_ids: tuple[int, ...]


class Generator:
    """Sampling from a policy: the run's vLLM engine when one is set and its context holds the call, else the JAX
    sampler on ``mesh``'s devices (the first device when None), rows split over all of them
    (``sharding.sampling_mesh``). Evaluation and the training step sample through it.
    ``compact_every`` goes to the JAX sampler (``rollout.compact_every``; None: the sampler's default)."""

    def __init__(self, policy: Policy, mesh: Mesh | None = None, vllm: Any = None, compact_every: int | None = None):
        self.policy, self.mesh, self.vllm = policy, sharding.sampling_mesh(sharding.mesh_or_local(mesh)), vllm
        self.jax_options = {} if compact_every is None else {"compact_every": compact_every}

    @property
    def tokenizer(self) -> Any:
        return self.policy.tokenizer

    def decoding(self, max_new_tokens: int, temperature: float, top_p: float, top_k: int) -> Decoding:
        return Decoding(max_new_tokens, temperature, top_p, top_k, self.policy.eos_ids)

    def generate(
        self, params: Params, prompts: Sequence[Sequence[int]], decoding: Decoding, *, key, n: int = 1,
        lora_scale: float = 0.0, fallback: bool = True, cancel: Callable[[], bool] | None = None,
    ) -> SampleBatch:  # fmt: skip
        """``n`` samples per prompt. With ``fallback`` (validation) the JAX sampler takes a call longer than the
        vLLM engine's context; without (rollouts), the engine takes every call and refuses one that is too long.
        ``cancel``: the JAX sampler's (``sampler.generate_arrays``); the vLLM engine runs its call to the end."""
        options = dict(key=key, n=n, lora_scale=lora_scale, **decoding.kwargs())
        if self.vllm is not None and not (fallback and self._too_long(prompts, decoding)):
            return self.vllm.generate_arrays(params, prompts, **options)
        jax_options = {**self.jax_options, "cancel": cancel}
        return generate_arrays(self.policy.config, params, prompts, mesh=self.mesh, **options, **jax_options)

    def _too_long(self, prompts: Sequence[Sequence[int]], decoding: Decoding) -> bool:
        return max(map(len, prompts)) + decoding.max_new_tokens > self.vllm.max_model_len
