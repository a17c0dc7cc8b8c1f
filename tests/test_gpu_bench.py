"""``benchmarks/gpu.py`` end to end at its ``--smoke`` shapes on the CPU, as the GPU run will call it: every key of
the JSON with sane values, and a section that fails or does not fit the time budget is recorded while the rest
is still written."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time

import pytest

from benchmarks import trace_summary, vllm_layout

pytestmark = pytest.mark.slow  # the GPU script's smoke run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_HF = all(importlib.util.find_spec(name) is not None for name in ("torch", "transformers"))
PHASES = {f"time_{name}" for name in ("sample", "reward", "sft", "reroll", "logprob", "update")}
RATES = ("sampler_tokens_per_s_b256", "sampler_tokens_per_s_b64", "train_tokens_per_s")
HF_RATES = ("hf_generate_tokens_per_s_b256", "hf_generate_tokens_per_s_b64", "hf_train_tokens_per_s")
REQUIRED = (
    *RATES,
    *HF_RATES,
    "sampler_ratio_vs_hf_b256",
    "sampler_ratio_vs_hf_b64",
    "sampler_floor_fraction_b256",
    "sampler_floor_fraction_b64",
    "train_mfu",
    "train_packed_speedup",
    "hf_train_mfu",
    "lspo_step_seconds",
    "scaffold_share",
    "lspo_phases",
    "date",
    "command",
    "jax_device",
    "torch_device",
    "versions",
    "shapes",
    "sections",
)


# Declared dependencies that the GPU machine's Python lacks (its package list is fixed; nothing can be fetched
# there). The script must run without them, so every run here hides them from every process it starts.
ABSENT_ON_GPU_MACHINE = ("math_verify", "latex2sympy2_extended", "tensorboardX", "vllm")
# None in sys.modules is what an absent package looks like to `import` (ModuleNotFoundError) and to
# importlib.util.find_spec (None), which availability probes such as transformers' use.
_HIDE_ABSENT = f"import sys\nsys.modules.update(dict.fromkeys({ABSENT_ON_GPU_MACHINE!r}))\n"


def run_bench(out_dir, *flags: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = os.path.join(out_dir, "gpu.json")
    # A sitecustomize.py on the path runs at the start of the script and of each section's subprocess.
    with open(os.path.join(out_dir, "sitecustomize.py"), "w") as f:
        f.write(_HIDE_ABSENT)
    path = os.pathsep.join([out_dir, ROOT, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": path}
    hidden = subprocess.run([sys.executable, "-c", "import math_verify"], env=env, capture_output=True, text=True)
    assert "ModuleNotFoundError" in hidden.stderr  # the hiding works, or the run would not show what it should
    cmd = [sys.executable, "-m", "benchmarks.gpu", "--smoke", "--out", out, *flags]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert os.path.exists(out), proc.stdout + proc.stderr
    with open(out) as f:
        return proc, json.load(f)


def positive(value) -> bool:
    return isinstance(value, float | int) and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict:
    proc, result = run_bench(str(tmp_path_factory.mktemp("smoke")), "--repeats", "1")  # one timed call suffices
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "scaffold_share" in proc.stdout  # the printed table
    return result


def test_every_key_and_no_failure(smoke):
    assert not [key for key in REQUIRED if key not in smoke]
    for name, section in smoke["sections"].items():
        if name == "vllm":  # vLLM hidden, as on the GPU machine: test_vllm_section_is_skipped_where_vllm_is_absent
            continue
        assert section["status"] == "ok", (name, section)
        skipped = section["skipped"]
        assert not skipped if HAS_HF else set(skipped) <= {"hf_generate_b256", "hf_generate_b64", "hf_train"}
    assert "--smoke" in smoke["command"] and smoke["shapes"]["preset"] == "tiny"
    assert smoke["jax_device"] and smoke["backend"] == "cpu"
    assert {"jax", "jaxlib", "flax", "optax", "transformers", "torch"} <= set(smoke["versions"])


def test_throughputs_and_mfu(smoke):
    assert all(positive(smoke[key]) for key in RATES), {key: smoke[key] for key in RATES}
    assert 0 < smoke["train_mfu"] < 1
    # Both attention kernels timed (cudnn runs as xla on the CPU), the fused one after agreeing with einsum.
    train = smoke["sections"]["train"]
    assert set(train["train_variants"]) == {"xla", "einsum"} and train["attention_check_xla"]["ok"]
    best = max(train["train_variants"].values(), key=lambda v: v["tokens_per_s"])
    assert (smoke["train_attention"], smoke["train_mfu"]) == (best["attention"], best["mfu"])
    for label in ("b256", "b64"):
        part = smoke["sections"]["sampler"][f"sampler_{label}"]
        fraction, floor_s, decode_s = smoke[f"sampler_floor_fraction_{label}"], part["floor_s"], part["decode_s"]
        # At smoke shapes timing noise can make the prompt pass look longer than the call: then no fraction.
        assert fraction == pytest.approx(floor_s / decode_s) and fraction > 0 if decode_s > 0 else fraction is None
    if HAS_HF:
        assert all(positive(smoke[key]) for key in HF_RATES), {key: smoke[key] for key in HF_RATES}
        assert 0 < smoke["hf_train_mfu"] < 1
        for label in ("b256", "b64"):
            ratio = smoke[f"sampler_tokens_per_s_{label}"] / smoke[f"hf_generate_tokens_per_s_{label}"]
            assert smoke[f"sampler_ratio_vs_hf_{label}"] == pytest.approx(ratio)
    else:
        assert all(smoke[key] is None for key in HF_RATES)


def test_lspo_step_and_scaffold_share(smoke):
    phases = smoke["lspo_phases"]
    assert PHASES <= set(phases) and all(v >= 0 for v in phases.values())
    # Every other group is a cliff, so the scaffold ran: adapter fitted, cliffs re-rolled, a row spliced.
    assert phases["time_sft"] > 0 and phases["time_reroll"] > 0
    assert positive(smoke["lspo_step_seconds"]) and sum(phases.values()) <= smoke["lspo_step_seconds"]
    assert 0 <= smoke["scaffold_share"] <= 1
    lspo = smoke["sections"]["lspo"]["lspo"]
    assert lspo["cliff_groups"] == smoke["shapes"]["lspo_prompts"] // 2 and lspo["spliced_rows"] >= 1
    assert positive(smoke["dapo_step_seconds"]) and "DAPO" in smoke["sections"]["lspo"]["scaffold_share_method"]


def test_failures_are_recorded_and_the_rest_written(tmp_path):
    # An unknown model preset fails the sampler before its first part and the LSPO section inside its part.
    proc, result = run_bench(str(tmp_path), "--only", "sampler,lspo", "--shape", "preset=no-such-model")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sections = result["sections"]
    assert sections["sampler"]["status"] == "failed" and "exited with code" in sections["sampler"]["error"]
    assert "no-such-model" in sections["sampler"]["errors"]["section"]
    assert sections["lspo"]["status"] == "failed" and "no-such-model" in sections["lspo"]["errors"]["lspo"]
    assert sections["train"] == {"status": "skipped", "reason": "not in --only"}
    assert all(key in result and result[key] is None for key in ("train_mfu", "lspo_step_seconds", "scaffold_share"))


def test_a_later_call_merges_the_sections_it_did_not_run(smoke, tmp_path):
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({**smoke, "sections": {**smoke["sections"], "lspo": {"status": "skipped"}}}))
    # Budget 1 s: every section is skipped for time now, and each one the earlier run has is taken from it, figures
    # included; its skipped LSPO section is not, so that one keeps the budget's reason.
    proc, result = run_bench(str(tmp_path), "--time-budget", "1", "--merge", str(earlier))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert result["merged"] == ["sampler", "train"] and "--merge" in result["command"]
    assert result["sections"]["train"]["merged_from"]["date"] == smoke["date"]
    lspo = result["sections"]["lspo"]
    assert lspo["status"] == "skipped" and lspo["reason"].startswith("time budget"), lspo
    assert result["lspo_step_seconds"] is None and result["lspo_phases"] is None
    keys = ("sampler_tokens_per_s_b256", "train_mfu", "train_attention") + HAS_HF * ("sampler_ratio_vs_hf_b64",)
    for key in keys:
        assert result[key] == smoke[key] is not None, key


def test_profile_summaries_in_the_smoke_run(smoke):
    for section, part in (("sampler", "sampler_b256"), ("train", "train_xla"), ("train", "train_einsum")):
        summary = smoke["sections"][section][f"profile_{part}"]
        assert summary["top"] and summary["total_ms"] > 0, (part, summary)


def test_vllm_section_is_skipped_where_vllm_is_absent(smoke):
    section = smoke["sections"]["vllm"]
    assert section["status"] == "skipped" and section["reason"].startswith("vllm cannot be imported here"), section
    assert "\n" not in section["reason"] and not section["errors"]
    assert all(smoke[key] is None for key in vllm_layout.HEADLINE_KEYS)


def test_vllm_figures_and_the_step_projection():
    def engine(tokens, seconds, sync_s, host_bytes=0):
        return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "sync_s": sync_s,
                "sync_host_bytes": host_bytes, "sync_dlpack_tensors": 339 - (host_bytes > 0)}  # fmt: skip

    # Two engines of 128 tokens, in 2 s (64 tokens/s) and 4 s (32 tokens/s): the step ends at 4 s, 256 / 4 = 64
    # tokens/s, 32 per GPU. The paper's step gives each 16 prompts x 16 x 8192 = 2,097,152 tokens: 32,768 s at 64
    # tokens/s, 65,536 s at 32. The sync figures are those of the slower sync.
    two = vllm_layout.summarize([engine(128, 2.0, 0.5), engine(128, 4.0, 0.7, host_bytes=10)])
    assert two == pytest.approx({
        "vllm_engines": 2, "vllm_sample_s": 4.0, "vllm_tokens_per_s": 64.0, "vllm_tokens_per_s_per_gpu": 32.0,
        "vllm_sync_s": 0.7, "vllm_sync_host_bytes": 10, "vllm_sync_dlpack_tensors": 338, "vllm_step_sample_s": 65536.0,
    })  # fmt: skip
    # Three engines: 32 prompts split 11, 11, 10. At 100, 100 and 80 tokens/s: 11 x 16 x 8192 / 100 = 14,417.92 s,
    # 10 x 16 x 8192 / 80 = 16,384 s, so the smaller block at the lower rate ends the step. 3000 tokens / 12.5 s = 240.
    three = vllm_layout.summarize([engine(1000, 10.0, 1.0), engine(1000, 10.0, 1.0), engine(1000, 12.5, 1.0)])
    assert three["vllm_step_sample_s"] == pytest.approx(16384.0)
    assert (three["vllm_tokens_per_s"], three["vllm_tokens_per_s_per_gpu"]) == pytest.approx((240.0, 80.0))


def test_vllm_workers_one_per_gpu_and_their_environment():
    assert vllm_layout.visible_gpus({"CUDA_VISIBLE_DEVICES": "3, 5"}) == ["3", "5"]
    assert vllm_layout.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert vllm_layout.engine_devices(False, {}, ["3", "5"]) == (["3", "5"], None)
    assert vllm_layout.engine_devices(True, {"JAX_PLATFORMS": "cpu"}, ["0"]) == ([None, None], None)  # the smoke
    devices, why_not = vllm_layout.engine_devices(False, {"JAX_PLATFORMS": "cpu"}, ["0"])
    assert devices == [] and "no GPU" in why_not
    base = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "3,5", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.92"}
    env = vllm_layout.worker_env(base, 1, 2, 4321, "5", 0.2)
    assert env == {
        **base, "CUDA_VISIBLE_DEVICES": "5", "JAX_COORDINATOR_ADDRESS": "localhost:4321", "JAX_NUM_PROCESSES": "2",
        "JAX_PROCESS_ID": "1", "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.2",
        "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
    }  # fmt: skip
    cpu = vllm_layout.worker_env({"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}, 0, 2, 4321, None, 0.2)
    assert cpu["JAX_PLATFORMS"] == "cpu" and cpu["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"  # the caller's setting kept
    assert "CUDA_VISIBLE_DEVICES" not in cpu and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in cpu
    # JAX's share and vLLM's split the device as mesh.memory_fraction does: 1 - 0.2 - the 0.05 margin.
    from benchmarks.common import Shapes

    spec = vllm_layout.worker_spec(Shapes(), 0, cpu=False)  # the GPU run's shapes: the paper's step
    assert (spec["dtype"], spec["jax_fraction"], spec["vllm_fraction"]) == ("bfloat16", 0.2, 0.75)
    assert (spec["prompts"], spec["group"], spec["prompt_len"], spec["new_tokens"]) == (32, 16, 256, 8192)


def test_only_out_of_memory_moves_to_the_next_remat_policy():
    from benchmarks.gpu import out_of_memory as oom

    assert oom(RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 12.50GiB."))
    assert oom(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))  # torch's wording
    assert not oom(RuntimeError("non-finite loss or gradient: {...}"))
    assert not oom(ValueError("INTERNAL: cuDNN error: CUDNN_STATUS_NOT_SUPPORTED"))


HANGING_PROFILE = """
import argparse, sys, time
from benchmarks import common
common.PROFILE_WATCHDOG_S = 1.0
args = argparse.Namespace(no_profile=False, profile=None, soft_deadline=None, smoke=False)
rec = common.Recorder({path!r}, "sampler", time.time())
rec.set(sampler_b256={{"new_tokens_per_s": 123.0}})
common.Context(args=args, shapes=common.Shapes(), rec=rec).profile_call("sampler_b256", lambda: time.sleep(600))
"""


def test_a_hanging_profile_ends_its_section_and_keeps_its_figures(tmp_path):
    path = str(tmp_path / "section.json")
    code = HANGING_PROFILE.format(path=path)
    path_var = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": path_var}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and time.monotonic() - start < 60, proc.stderr[-2000:]
    with open(path) as f:
        assert json.load(f)["sampler_b256"] == {"new_tokens_per_s": 123.0}


def test_trace_summary_reads_the_busiest_device_timeline():
    meta = lambda kind, pid, name, tid=0: {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": {"name": name}}
    op = lambda pid, tid, name, ts, dur: {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}
    events = [
        meta("process_name", 1, "/device:GPU:0"),
        meta("process_name", 2, "/host:CPU"),
        meta("thread_name", 1, "XLA Ops", 10),
        meta("thread_name", 1, "XLA Modules", 11),
        op(1, 10, "fusion.1", 0, 30),
        op(1, 10, "fusion.2", 30, 10),
        op(1, 10, "fusion.1", 40, 20),
        op(1, 11, "jit_step", 0, 60),  # the module span over the same ops: a coarser timeline, not summed
        op(2, 5, "host_work", 0, 500),  # host events are ignored when the trace has a device
    ]
    summary = trace_summary.summarize_events(events)
    assert summary["timeline"] == "/device:GPU:0 / XLA Ops" and summary["source"] == "device"
    # fusion.1: 30 + 20 = 50 us of 60 us -> 0.05 ms, share 5/6; fusion.2: 10 us -> share 1/6.
    assert summary["total_ms"] == pytest.approx(0.06)
    assert [(r["name"], r["count"]) for r in summary["top"]] == [("fusion.1", 2), ("fusion.2", 1)]
    assert [r["share"] for r in summary["top"]] == pytest.approx([5 / 6, 1 / 6])


def test_trace_summary_of_a_host_trace_counts_self_time():
    op = lambda name, ts, dur: {"ph": "X", "pid": 2, "tid": 5, "name": name, "ts": ts, "dur": dur}
    events = [
        op("$gpu.py:400 main", 0, 1000),  # a Python frame: left out
        op("while.3", 0, 100),
        op("dot.1", 10, 30),  # nested in while.3
        op("fusion.2", 50, 20),  # nested in while.3
        op("fusion.2", 200, 40),
    ]
    summary = trace_summary.summarize_events(events)
    # while.3's self time is 100 - 30 - 20 = 50 us; fusion.2 20 + 40 = 60 us; dot.1 30 us; total 140 us.
    assert summary["source"] == "host" and summary["total_ms"] == pytest.approx(0.14)
    want = {"fusion.2": 0.06, "while.3": 0.05, "dot.1": 0.03}
    assert {r["name"]: r["ms"] for r in summary["top"]} == pytest.approx(want)


def test_the_full_shapes_on_a_machine_without_a_gpu_are_refused_in_one_line(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "benchmarks.gpu", "--out", str(tmp_path / "gpu.json")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert (
        proc.stderr.startswith("benchmarks.gpu: JAX finds no GPU here (its backend is cpu)")
        and "--smoke" in proc.stderr
    )
    assert not (tmp_path / "gpu.json").exists()  # nothing timed, nothing written
