"""One process of a two-process job (joined by ``jax.distributed``, one CPU device each) that checks the vLLM engine's
multi-process parts without vLLM: ``python tests/helpers/vllm_sync_checks.py PORT PROCESS_ID``, run by
``test_vllm_multiprocess.py``.

The params are sharded over both processes' devices (``fsdp = 2``), so neither process can read them as host arrays.
An engine whose ``llm`` is a stand-in (it records the tensors a push hands over and answers each request with tokens
made from its prompt and seed) goes through ``VLLMSampler``'s own ``sync_weights`` and ``generate_arrays``. The
process prints one JSON line of what it saw.
"""

from __future__ import annotations

import collections
import json
import sys
from types import SimpleNamespace

import jax
import numpy as np

MARKER = "VLLM_SYNC_CHECKS_JSON "
PROMPTS = [[3, 4], [5], [6, 7, 8], [9], [10, 11]]  # 5 prompts over 2 engines: blocks of 3 and 2
N, NEW = 2, 4


class FakeLLM:
    """What ``VLLMSampler`` calls on ``vllm.LLM``: the pushed tensors are kept (copied), each request answered with
    ``NEW`` tokens ``(seed + j, prompt[0], ...)`` for its ``j``-th sample."""

    def __init__(self):
        self.pushed: dict[str, np.ndarray] = {}
        self.prompts_seen: list[list[int]] = []

    def collective_rpc(self, method: str, kwargs: dict) -> None:
        assert method == "reload_weights"
        for name, tensor in kwargs["weights_iterator"]:
            self.pushed[name] = tensor.numpy().copy()

    def reset_prefix_cache(self) -> bool:
        return True

    def generate(self, requests, params_list, use_tqdm=False):
        outputs = []
        for request, sp in zip(requests, params_list, strict=True):
            prompt = request["prompt_token_ids"]
            self.prompts_seen.append(prompt)
            samples = []
            for j in range(sp.n):
                ids = [sp.seed + j, prompt[0], len(prompt), 1][:NEW]
                logprobs = [{t: SimpleNamespace(logprob=-0.5)} for t in ids]
                samples.append(SimpleNamespace(index=j, token_ids=ids, logprobs=logprobs, finish_reason="length"))
            outputs.append(SimpleNamespace(outputs=samples, num_cached_tokens=0))
        return outputs


def fake_engine(config):
    import torch

    from lspo_jax.rollout.vllm_sampler import VLLMSampler

    engine = VLLMSampler.__new__(VLLMSampler)  # no vLLM: the parts generate_arrays and sync_weights use
    engine._torch, engine._vllm = torch, SimpleNamespace(SamplingParams=lambda **kw: SimpleNamespace(**kw))
    engine.config, engine.logprobs_mode, engine.llm = config, "processed_logprobs", FakeLLM()
    engine.max_model_len, engine.dtype, engine.engine_device = 64, torch.float32, "cpu"
    engine._held, engine._warned = {"layers": None, "outer": None}, set()
    engine.stats = collections.defaultdict(float, engines=jax.process_count())
    return engine


def main(port: int, process_id: int) -> dict:
    jax.config.update("jax_platforms", "cpu")
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)
    from lspo_jax.config import ModelConfig
    from lspo_jax.models import hf, sharding, specs

    config = ModelConfig.preset("tiny")
    rng = np.random.default_rng(0)  # the same draws in both processes
    leaves = jax.tree.map(lambda a: (0.1 * rng.standard_normal(a.shape)).astype(np.float32),
                          specs.abstract_params(config))  # fmt: skip
    mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=2))
    params = sharding.shard_params(jax.tree.map(np.asarray, leaves), sharding.param_shardings(config, mesh))
    spans = not params["base"]["embed"].is_fully_addressable
    engine = fake_engine(config)
    batch = engine.generate_arrays(params, PROMPTS, key=jax.random.key(7), max_new_tokens=NEW, n=N)
    want = dict(hf.to_hf_state_dict(config, {"base": leaves["base"]}))
    pushed = engine.llm.pushed
    return {
        "process": process_id,
        "params_span_processes": spans,
        "pushed_names_equal": list(pushed) == list(want),
        "pushed_values_equal": all(np.array_equal(pushed[k], want[k]) for k in want),
        "host_bytes": engine.stats["sync_host_bytes"],
        "dlpack_tensors": engine.stats["sync_dlpack_tensors"],
        "tensors": len(want),
        "prompts_seen": engine.llm.prompts_seen,
        "tokens": batch.tokens.tolist(),
        "lengths": batch.lengths.tolist(),
        "steps": batch.steps,
        "engine_prompts": engine.stats["last_engine_prompts"],
        "seed": int(jax.random.bits(jax.random.key(7), (), np.uint32)) >> 1,
    }


if __name__ == "__main__":
    result = main(int(sys.argv[1]), int(sys.argv[2]))
    jax.distributed.shutdown()
    print(MARKER + json.dumps(result), flush=True)
