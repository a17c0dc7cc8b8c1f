"""transformers + torch at our shapes: the baseline that ``benchmarks/gpu.py`` and ``tools/bench_sampler.py`` time
our sampler and RL step against, written once so that both measure the same thing.

The model is a randomly initialised ``Qwen2ForCausalLM`` of our ``ModelConfig`` (sdpa attention). Sampling is
``generate()`` at temperature 1 with top-k and top-p off and ``min_new_tokens = max_new_tokens``, so every row makes
exactly ``new_tokens`` tokens (EOS forbidden), as our sampler does with an empty EOS set. Training is the usual
recipe: float32 weights, ``torch.autocast`` bf16, mean next-token cross-entropy (``labels = input_ids``),
global-norm clipping at 1.0 (as our optimizer), fused AdamW on CUDA. torch is imported on first use.
"""

from __future__ import annotations

import gc
import time

import numpy as np

from lspo_jax.config import ModelConfig


def device(allow_cpu: bool) -> tuple[str | None, str, dict]:
    """``('cuda' | 'cpu', '', versions)`` where transformers can run, else ``(None, why not, versions)``."""
    try:
        import torch
        import transformers
    except ImportError as err:
        return None, f"transformers + torch not importable: {err}", {}
    versions = dict(torch_version=torch.__version__, transformers_version=transformers.__version__)
    if torch.cuda.is_available():
        versions.update(torch_device=torch.cuda.get_device_name(0), torch_cuda=torch.version.cuda)
        versions.update(torch_cudnn=torch.backends.cudnn.version())
        return "cuda", "", versions
    if allow_cpu:
        return "cpu", "", versions
    return None, "torch has no CUDA device (CPU runs only with --smoke)", versions


def model(config: ModelConfig, device: str, dtype: str):
    """The random ``Qwen2ForCausalLM`` of ``config`` on ``device`` in ``dtype`` (a torch dtype's name), seed 0."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        built = Qwen2ForCausalLM(Qwen2Config(**config.to_hf_config(), attn_implementation="sdpa"))
    return built.to(getattr(torch, dtype))


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def release(device: str) -> None:
    """Give torch's cached blocks back to the device, so that JAX, next, has the memory."""
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def time_generate(hf_model, device: str, prompts: np.ndarray, new_tokens: int) -> dict:
    """``{"warmup_s", "time_s"}``: a short warm-up call (kernels, allocator), then one timed call of ``new_tokens``
    new tokens on every row of ``prompts`` (int ids, no padding)."""
    import torch

    ids = torch.from_numpy(prompts).long().to(device)
    gen = dict(
        attention_mask=torch.ones_like(ids),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,  # forbids EOS: exactly new_tokens tokens per row
        pad_token_id=0,
    )
    with torch.inference_mode():
        start = time.perf_counter()
        hf_model.generate(ids, **{**gen, "max_new_tokens": 8, "min_new_tokens": 8})
        sync(device)
        warm_s = time.perf_counter() - start
        start = time.perf_counter()
        out = hf_model.generate(ids, **gen)
        sync(device)
        time_s = time.perf_counter() - start
    if out.shape[1] != prompts.shape[1] + new_tokens:
        raise RuntimeError(f"generate returned {out.shape[1] - prompts.shape[1]} new tokens, not {new_tokens}")
    return {"warmup_s": warm_s, "time_s": time_s}


def time_train(config: ModelConfig, device: str, ids: np.ndarray, steps: int) -> dict:
    """``{"warmup_s", "step_s", "loss", "peak_gb"}``: two warm-up steps, then the mean of ``steps`` timed steps on
    the rows ``ids`` (peak memory on CUDA only)."""
    import torch

    hf_model = model(config, device, "float32").train()
    # fused: one kernel for the whole update on CUDA, as recipes use it; the CPU build takes the default path.
    opt = torch.optim.AdamW(hf_model.parameters(), lr=1e-6, weight_decay=0.01, fused=device == "cuda")
    rows = torch.from_numpy(ids).long().to(device)

    def step() -> torch.Tensor:
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            loss = hf_model(input_ids=rows, labels=rows, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf_model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    start = time.perf_counter()
    for _ in range(2):
        step()
    sync(device)
    warm_s = time.perf_counter() - start
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    sync(device)
    step_s = (time.perf_counter() - start) / steps
    peak = round(torch.cuda.max_memory_allocated() / 1e9, 2) if device == "cuda" else None
    return {"warmup_s": warm_s, "step_s": step_s, "loss": float(loss.detach()), "peak_gb": peak}
