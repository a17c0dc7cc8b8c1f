"""Sampling rollouts: the KV cache (``kv_cache``), the JAX sampler (``sampler``: a call's plan and decode loop; its
jitted programs in ``programs``, its weights' layout in ``sampler_weights``, the token draw in ``sampling``; its
programs traced for abstract inputs, to lower for any platform, in ``lowering``), what a call takes and returns
(``samples``), the vLLM engine behind the same call (``vllm_sampler``, its weight push in ``vllm_weights``) and
``generator``, the one call evaluation and the training step sample through. Imports the root and ``models``."""

from lspo_jax import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {"generate": "sampler", "generate_arrays": "sampler"})
