"""Sampling rollouts: the KV cache (``kv_cache``), the JAX sampler (``sampler``; its programs traced for abstract
inputs, to lower for any platform, in ``lowering``), the vLLM engine behind the same call (``vllm_sampler``) and
``generator``, the one call evaluation and the training step sample through. Imports the root and ``models``."""

from lspo_jax import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {"generate": "sampler", "generate_arrays": "sampler"})
