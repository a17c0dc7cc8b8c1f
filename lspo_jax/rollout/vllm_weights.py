"""The weight push into a running vLLM engine (``vllm_sampler.VLLMSampler``), tensor by tensor, from the JAX params.

How the weights get there:

* ``model_dir`` is a Hugging Face directory (``hf.save_pretrained`` plus a tokenizer) that gives vLLM the
  architecture and the weights it starts with; after that, the weights come from the JAX params.
* Every ``generate_arrays`` first makes sure the engine holds the weights of the params it was given: the
  base for ``lora_scale == 0``, the merged ``W + (alpha / rank) * lora_scale * A B`` (``lora.merge_lora``)
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
"""

from __future__ import annotations

import functools
import logging
import math
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from lspo_jax.config import ModelConfig
from lspo_jax.models import hf
from lspo_jax.models.specs import Params

LAYERS, OUTER = "layers", "outer"  # the two parts tracked: decoder layers; embeddings, final norm, head


# vLLM's in-place reload restores every module it was given nothing for, and says so at WARNING level for
# each (and for buffers such as the rotary tables, which are never in a checkpoint); a partial push is
# deliberate here, so those two messages are dropped while a push runs.
_EXPECTED_RELOAD_MESSAGES = ("Failed to load weights", "Following weights were not loaded")


class _DropExpectedReloadWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(m in str(record.msg) for m in _EXPECTED_RELOAD_MESSAGES)


class Held:
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
    if OUTER in parts:
        for rule in (r for r in outer if r.path == ("embed",)):
            yield rule.hf, tensor(rule, whole(rule))
    if LAYERS in parts:
        stacked = {rule.hf: whole(rule) for rule in rules if rule.layered}
        for i in range(config.num_layers):
            for rule in (r for r in rules if r.layered):
                yield rule.hf.format(i=i), tensor(rule, stacked[rule.hf][i])
        del stacked
    if OUTER in parts:
        for rule in (r for r in outer if r.path != ("embed",)):
            yield rule.hf, tensor(rule, whole(rule))


def push(llm: Any, tensors: Iterator[tuple[str, Any]]) -> int:
    """Hand ``tensors`` to the running engine's in-place ``reload_weights`` (modules given nothing keep theirs), its
    expected warnings about those dropped; the number of tensors pushed."""
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
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": counted()})
    finally:
        for lg in loggers:
            lg.removeFilter(drop)
    return count
