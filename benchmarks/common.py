"""What the GPU benchmark's sections share (``benchmarks.gpu`` runs them, ``benchmarks.vllm_layout`` is one): the
shapes, the time estimates that decide what fits a budget, and the record a section writes as it goes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import importlib.util
import json
import os
import shutil
import tempfile
import time
import traceback
from typing import Any

import jax

from benchmarks import trace_summary

# Rough seconds per part on the H200, compile included; --smoke scales them by SMOKE_SCALE. Used only to skip
# work that would not fit in --time-budget. Core parts decide whether a section starts; optional parts are
# skipped when they would eat into the time the later sections need.
ESTIMATE_S = {
    "startup": 20,
    "sampler_b256": 120,  # the decode step's layers are unrolled: slower to compile than a scan
    "hf_generate_b256": 60,
    "sampler_b64": 60,
    "hf_generate_b64": 45,
    "sampler_mixed_b256": 60,  # the uniform call's programs plus those of the smaller row buckets
    "sampler_pallas_b256": 120,
    "hf_train": 40,
    "train": 80,
    "attention_check": 30,
    "train_packed": 150,  # the padded step and two packed ones, each compiled once
    "lspo": 180,
    "dapo_step": 20,
    "profile": 40,  # one more call under jax.profiler, and reading its trace
    # Writing the model, an engine start per GPU, two syncs, 32 x 16 x 8192 tokens; nothing where vLLM is absent.
    "vllm": 420 if importlib.util.find_spec("vllm") else 0,
}


PROFILE_WATCHDOG_S = 180  # a profiler that hangs (CUPTI under a sandbox) ends its section after this


SMOKE_SCALE = 0.05


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Every size the benchmark uses; ``--shape name=value`` overrides one."""

    preset: str = "deepseek-r1-distill-qwen-1.5b"
    sampler_prompt_len: int = 256
    sampler_new_tokens: int = 512
    sampler_batch_b256: int = 256
    sampler_batch_b64: int = 64
    train_rows: int = 8
    train_seq: int = 2048
    train_steps: int = 3  # timed steps, after one compiling step (HF: after two warm-up steps)
    lspo_prompts: int = 4
    lspo_group: int = 16
    lspo_prompt_len: int = 64
    lspo_new_tokens: int = 512
    lspo_solution_len: int = 512
    lspo_micro_batches: int = 4
    lspo_sft_steps: int = 4
    vllm_prompts: int = 32
    vllm_group: int = 16
    vllm_prompt_len: int = 256
    vllm_new_tokens: int = 8192


SMOKE_SHAPES = Shapes(
    preset="tiny",
    sampler_prompt_len=16,
    sampler_new_tokens=8,
    sampler_batch_b256=8,
    sampler_batch_b64=6,  # the sampler's batch bucket of 6 is 8: the second batch reuses the compiled programs
    train_rows=2,
    train_seq=64,
    train_steps=1,
    lspo_prompts=2,
    lspo_group=2,
    lspo_prompt_len=8,
    lspo_new_tokens=8,
    lspo_solution_len=16,
    lspo_micro_batches=1,
    lspo_sft_steps=2,
    vllm_prompts=4,
    vllm_group=2,
    vllm_prompt_len=16,
    vllm_new_tokens=16,
)


def estimate_s(part: str, smoke: bool) -> float:
    return ESTIMATE_S[part] * (SMOKE_SCALE if smoke else 1.0)


def log(t0: float, where: str, message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} +{time.time() - t0:7.1f}s [{where}] {message}", flush=True)


def write_json(path: str, data: dict) -> None:
    """Write atomically: a reader (or a kill mid-write) never sees half a file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, default=str)
    os.replace(tmp, path)


class Recorder:
    """One section's results, rewritten to ``path`` after every part, so a killed section leaves what it measured.

    ``part(name)`` times a block and records an exception as ``errors[name]`` instead of raising it, so the
    next part still runs.
    """

    def __init__(self, path: str, section: str, t0: float):
        self.path, self.section, self.t0 = path, section, t0
        self.data: dict[str, Any] = {"section": section, "headline": {}, "errors": {}, "skipped": {}, "parts_s": {}}
        self.flush()

    def flush(self) -> None:
        write_json(self.path, self.data)

    def set(self, **values: Any) -> None:
        self.data.update(values)
        self.flush()

    def headline(self, **values: Any) -> None:
        self.data["headline"].update(values)
        self.flush()

    def log(self, message: str) -> None:
        log(self.t0, self.section, message)

    def skip(self, part: str, why: str) -> None:
        self.data["skipped"][part] = why
        self.log(f"{part}: skipped ({why})")
        self.flush()

    @contextlib.contextmanager
    def part(self, name: str):
        self.log(f"{name}: start")
        start = time.perf_counter()
        try:
            yield
        except Exception as err:  # recorded, not raised: the remaining parts still run
            traceback.print_exc()
            self.data["errors"][name] = f"{type(err).__name__}: {err}"[:4000]
            self.log(f"{name}: FAILED {type(err).__name__}")
        else:
            self.log(f"{name}: done in {time.perf_counter() - start:.1f} s")
        finally:
            self.data["parts_s"][name] = round(time.perf_counter() - start, 3)
            self.flush()


@dataclasses.dataclass
class Context:
    """What a section's parts share: arguments, shapes, the record, the soft deadline for optional parts."""

    args: argparse.Namespace
    shapes: Shapes
    rec: Recorder

    def room_for(self, part: str) -> str | None:
        """None when optional ``part`` fits before the soft deadline, else why it is skipped."""
        if self.args.soft_deadline is None:
            return None
        left, need = self.args.soft_deadline - time.time(), estimate_s(part, self.args.smoke)
        return None if left >= need else f"time budget: {left:.0f} s left for this section's extras, needs ~{need:.0f}"

    def profile(self, part: str):
        if not self.args.profile:
            return contextlib.nullcontext()
        return jax.profiler.trace(os.path.join(self.args.profile, part))

    def profile_call(self, part: str, call) -> None:
        """``call()`` once more under ``jax.profiler``, after the timed runs: where its device time went (top ops
        of the busiest timeline) goes into ``profile_<part>``. A failure is recorded; the part's timings stand."""
        if self.args.no_profile:
            return
        skip = self.room_for("profile")
        if skip:
            self.rec.skip(f"profile_{part}", skip)
            return
        root = self.args.profile or tempfile.mkdtemp(prefix="gpu_bench_trace_")
        path = os.path.join(root, part)
        # Every figure is on disk before this runs. A hang would hold the section until the budget's end and
        # starve the later sections, so a watchdog thread ends the process instead (the parent records it).
        limit = PROFILE_WATCHDOG_S * (SMOKE_SCALE if self.args.smoke else 1.0) + 60 * self.args.smoke
        self.rec.set(**{f"profile_{part}": {"error": f"watchdog: no result within {limit:.0f} s"}})  # until done
        faulthandler.dump_traceback_later(limit, exit=True)
        try:
            with jax.profiler.trace(path):
                jax.block_until_ready(call())
            summary = trace_summary.summarize_trace(path)
        except Exception as err:  # a profiler that cannot start (e.g. CUPTI missing) costs only the summary
            summary = {"error": f"{type(err).__name__}: {err}"[:2000]}
        finally:
            faulthandler.cancel_dump_traceback_later()
            if not self.args.profile:
                shutil.rmtree(root, ignore_errors=True)
        self.rec.set(**{f"profile_{part}": summary})
        self.rec.log(f"profile of {part}: {trace_summary.format_summary(summary)}")
