"""Greedy rollouts of one vLLM engine, or of one engine in each process of a two-process job, written to a file:
``python tests/helpers/vllm_greedy_checks.py OUT`` (one process) or
``python tests/helpers/vllm_greedy_checks.py OUT PORT PROCESS_ID`` (one of two joined by ``jax.distributed``), run by
``test_vllm_multiprocess.py``.

Every process saves the same random float32 Qwen2 (``vllm_checks.CONFIG``, seed 0) to a directory of its own and
starts an engine on it; ``VLLMSampler.generate_arrays`` samples the prompts greedily, each engine its block of them
(``prompt_share``), and the process writes ``OUT.PROCESS_ID.npz`` (``OUT.0.npz`` alone): the rows it got back
(``tokens``, ``logprobs``, ``lengths``, ``eos``, ``steps``), the prompt (its index) of each request its own engine
was given, and the engine's ``engines`` and ``last_engine_prompts`` stats.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import jax
import numpy as np

PROMPT_LENGTHS = [5, 9, 3, 14, 7]  # 5 prompts: blocks of 3 and 2 over two engines, of different lengths
N, NEW = 2, 12


def prompts() -> list[list[int]]:
    from lspo_jax.tasks import toy

    rng = np.random.default_rng(3)
    return [[toy.BOS_ID, *rng.integers(4, toy.vocab_size(), size=k - 1).tolist()] for k in PROMPT_LENGTHS]


def main(out: str, workdir: str) -> None:
    from vllm_checks import CONFIG, random_params

    from lspo_jax.models import hf
    from lspo_jax.rollout.vllm_sampler import VLLMSampler
    from lspo_jax.tasks import toy

    params = random_params()
    hf.save_pretrained(workdir, CONFIG, params)
    toy.char_tokenizer().save_pretrained(workdir)
    engine = VLLMSampler(workdir, CONFIG, kv_cache_space_gib=1, dtype="float32", max_model_len=64, seed=0)
    asked, generate, requests = prompts(), engine.llm.generate, []  # requests: the index of each one's prompt

    def counted(reqs, *args, **kwargs):
        requests.extend(asked.index(r["prompt_token_ids"]) for r in reqs)
        return generate(reqs, *args, **kwargs)

    engine.llm.generate = counted
    try:
        batch = engine.generate_arrays(params, asked, key=jax.random.key(5), max_new_tokens=NEW, n=N, greedy=True)
    finally:
        engine.close()
    np.savez(f"{out}.{jax.process_index()}.npz", tokens=batch.tokens, logprobs=batch.logprobs, lengths=batch.lengths,
             eos=batch.eos, steps=batch.steps, requests=requests, engines=engine.stats["engines"],
             engine_prompts=engine.stats["last_engine_prompts"])  # fmt: skip


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    jax.config.update("jax_platforms", "cpu")
    if len(sys.argv) == 4:
        jax.distributed.initialize(f"localhost:{sys.argv[2]}", num_processes=2, process_id=int(sys.argv[3]))
    workdir = tempfile.mkdtemp(prefix="vllm_greedy_checks_")
    try:
        main(sys.argv[1], workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if len(sys.argv) == 4:
        jax.distributed.shutdown()
