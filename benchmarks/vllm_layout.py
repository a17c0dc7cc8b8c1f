"""The vLLM layout at the paper's shape, the ``vllm`` section of ``benchmarks/gpu.py``: one JAX process per device,
each with its own in-process vLLM engine (``rollout.engine: vllm``, ``docs/multihost.md``), the processes joined by
``jax.distributed``.

The section's process (``section``) starts one worker per visible GPU (``CUDA_VISIBLE_DEVICES`` set to one GPU per
worker; with ``--smoke`` on a CPU, two CPU processes) with a coordinator on localhost, and records what they measured.
Each worker (``python -m benchmarks.vllm_layout WORKDIR PARENT_PID``):

1. draws random params of the benchmark's shape, sharded over a mesh of every process's device (``fsdp``);
2. process 0 writes the same weights once as a Hugging Face directory with a generated word-level tokenizer of the
   model's vocabulary (one word per id: the real Qwen2 vocabulary may be absent), which every engine starts from;
3. starts the project's engine (``vllm_sampler.VLLMSampler``) on it, warms it up, and times a full weight sync from
   the sharded params, after an untimed one that compiles the gathers and casts (the engine's ``stats``);
4. samples the step's prompts through ``generate_arrays`` (its engine takes its block, ``prompt_share``) with no
   EOS, so every row runs ``new_tokens``, and times its own engine's generate call: the call as a whole also waits
   in the all-gather for the slowest engine.

The section runs only where vLLM imports; elsewhere (the GPU machine, whose Python has no vLLM) it is recorded as
skipped with the reason.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.experimental import multihost_utils

from benchmarks.common import Context, Shapes
from lspo_jax.config import ModelConfig
from lspo_jax.models import hf, sharding
from lspo_jax.models.specs import init_params
from lspo_jax.rollout.vllm_sampler import VLLMSampler, prompt_share
from lspo_jax.rollout.vllm_setup import check_model
from lspo_jax.train_config import MeshSection

HEADLINE_KEYS = (
    "vllm_engines",
    "vllm_sample_s",
    "vllm_tokens_per_s",
    "vllm_tokens_per_s_per_gpu",
    "vllm_sync_s",
    "vllm_sync_host_bytes",
    "vllm_sync_dlpack_tensors",
    "vllm_step_sample_s",
)


class Step(NamedTuple):
    prompts: int
    group: int
    new_tokens: int


# The rollouts of one step of configs/lspo_deepmath_r1_distill_qwen_1p5b.yaml, whatever shape was measured.
PAPER_STEP = Step(prompts=32, group=16, new_tokens=8192)
STEP_FORMULA = "max over engines e of |prompt_share(32, e, N)| x 16 x 8192 / (tokens_e / seconds_e), N engines"
# JAX holds only the params and a sync's transients here; vLLM takes the rest but the margin (MeshSection).
JAX_FRACTION = 0.2
FAILED_WORKER_GRACE_S = 30  # the others wait in a collective for a failed worker: ended after this


# ------------------------------------------------------------------------------------------ the section
def section(ctx: Context) -> None:
    """The ``vllm`` section of ``benchmarks.gpu``: the workers started, what they measured recorded."""
    rec, shapes = ctx.rec, ctx.shapes
    devices, why_not = engine_devices(ctx.args.smoke, os.environ, visible_gpus(os.environ))
    why_not = vllm_missing() or why_not
    if why_not:
        rec.set(status="skipped", reason=why_not)
        rec.log(f"skipped ({why_not})")
        return
    with rec.part("vllm"):
        if shapes.vllm_prompts < len(devices):
            raise ValueError(f"{shapes.vllm_prompts} prompts for {len(devices)} engines: each needs one to time")
        spec = worker_spec(shapes, ctx.args.seed, cpu=devices[0] is None)
        rec.set(vllm_spec=spec, vllm_devices=devices)
        engines = run_workers(spec, devices, rec.log)
        first = engines[0]
        rec.set(vllm_engine_results=engines, backend=first["backend"], jax_device=first["jax_device"])
        rec.headline(**summarize(engines))


def vllm_missing() -> str | None:
    """None where ``import vllm`` works, else why not, in one line."""
    try:
        importlib.import_module("vllm")
    except Exception as err:  # absent, or broken beside this torch: the section cannot run either way
        first_line = (str(err).splitlines() or [""])[0]
        return f"vllm cannot be imported here ({type(err).__name__}: {first_line})"
    return None


def visible_gpus(env: Mapping[str, str]) -> list[str]:
    """The GPUs this process may use, one ``CUDA_VISIBLE_DEVICES`` value each, found without starting CUDA here
    (a context would take memory on every GPU from the engines): the variable where set, else ``nvidia-smi``."""
    if "CUDA_VISIBLE_DEVICES" in env:
        return [d.strip() for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    try:
        query = ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"]
        out = subprocess.run(query, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return out.stdout.split() if out.returncode == 0 else []


def engine_devices(smoke: bool, env: Mapping[str, str], gpus: list[str]) -> tuple[list[str | None], str | None]:
    """One entry per engine, the GPU its worker sees (None: a CPU worker), and why there are none."""
    if env.get("JAX_PLATFORMS") == "cpu" or not gpus:
        if smoke:
            return [None, None], None
        return [], "no GPU visible: one engine per GPU (--smoke runs two CPU engines)"
    return list(gpus), None


def worker_spec(shapes: Shapes, seed: int, *, cpu: bool) -> dict[str, Any]:
    """What every worker reads: the model, the step it samples, the dtypes and memory shares."""
    jax_share, vllm_share = MeshSection(memory_fraction=JAX_FRACTION).memory_fractions("vllm")
    return {
        "preset": shapes.preset,
        "prompts": shapes.vllm_prompts,
        "group": shapes.vllm_group,
        "prompt_len": shapes.vllm_prompt_len,
        "new_tokens": shapes.vllm_new_tokens,
        "seed": seed,
        "cpu": cpu,
        # bf16 as a run computes on a GPU; float32 on the CPU, as the project's vLLM tests run its CPU build.
        "dtype": "float32" if cpu else "bfloat16",
        "jax_fraction": jax_share,
        "vllm_fraction": vllm_share,
    }


def worker_env(
    base: Mapping[str, str], process_id: int, count: int, port: int, gpu: str | None, jax_fraction: float
) -> dict[str, str]:
    """The environment of worker ``process_id`` of ``count``: joined through ``localhost:port``, on GPU ``gpu`` alone
    (None: the CPU)."""
    env = dict(base)
    env.update(
        JAX_COORDINATOR_ADDRESS=f"localhost:{port}",
        JAX_NUM_PROCESSES=str(count),
        JAX_PROCESS_ID=str(process_id),
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
    )
    if gpu is None:
        env["JAX_PLATFORMS"] = "cpu"
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # else vLLM's model runs on one core of two
        return env
    # JAX's share set before it starts (preallocated, it would take 75% up front); vLLM's is its own argument.
    env.update(
        CUDA_VISIBLE_DEVICES=gpu,
        XLA_PYTHON_CLIENT_PREALLOCATE="false",
        XLA_PYTHON_CLIENT_MEM_FRACTION=str(jax_fraction),
    )
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run_workers(spec: dict, devices: list[str | None], report: Callable[[str], None]) -> list[dict]:
    """Start one worker per entry of ``devices``, wait for all, and return their records in process order."""
    workdir = tempfile.mkdtemp(prefix="gpu_bench_vllm_")
    procs: list[subprocess.Popen] = []
    try:
        with open(os.path.join(workdir, "spec.json"), "w") as f:
            json.dump(spec, f)
        port, root = free_port(), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        cmd = [sys.executable, "-m", "benchmarks.vllm_layout", workdir, str(os.getpid())]
        for i, gpu in enumerate(devices):
            env = worker_env(os.environ, i, len(devices), port, gpu, spec["jax_fraction"])
            procs.append(subprocess.Popen(cmd, cwd=root, env=env))
        report(f"{len(procs)} workers started ({'CPU' if devices[0] is None else 'GPUs ' + ','.join(devices)})")
        codes = wait_all(procs)
        records = [read_record(workdir, i) for i in range(len(devices))]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(workdir, ignore_errors=True)
    failures = [
        f"engine {i}: exit {code}, {record.get('error', 'no error recorded')}"
        for i, (code, record) in enumerate(zip(codes, records, strict=True))
        if code != 0 or "error" in record
    ]
    if failures:
        raise RuntimeError("; ".join(failures))
    return records


def wait_all(procs: list[subprocess.Popen]) -> list[int]:
    """Every worker's exit code. Once one has failed the others would wait for it in a collective until JAX's
    heartbeat gives up (minutes): they get ``FAILED_WORKER_GRACE_S``, then are killed."""
    failed_at = None
    while any(p.poll() is None for p in procs):
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > FAILED_WORKER_GRACE_S:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.5)
    return [p.returncode for p in procs]


def read_record(workdir: str, process_id: int) -> dict:
    try:
        with open(record_path(workdir, process_id)) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        return {"process": process_id, "error": f"no record: {err}"}


def record_path(workdir: str, process_id: int) -> str:
    return os.path.join(workdir, f"engine.{process_id}.json")


def summarize(engines: list[dict], step: Step = PAPER_STEP) -> dict[str, Any]:
    """The headline figures of the engines' records (process order): the step's sampling ends with its slowest
    engine, so the aggregate rate is every engine's tokens over that engine's seconds, and the projection of
    ``step`` takes each engine's block of it at that engine's own rate (``STEP_FORMULA``)."""
    count = len(engines)
    wall = max(e["seconds"] for e in engines)
    rate = sum(e["tokens"] for e in engines) / wall
    step_s = max(
        _block(step.prompts, i, count) * step.group * step.new_tokens / e["tokens_per_s"] for i, e in enumerate(engines)
    )
    slowest_sync = max(engines, key=lambda e: e["sync_s"])
    return {
        "vllm_engines": count,
        "vllm_sample_s": wall,
        "vllm_tokens_per_s": rate,
        "vllm_tokens_per_s_per_gpu": rate / count,
        "vllm_sync_s": slowest_sync["sync_s"],
        "vllm_sync_host_bytes": slowest_sync["sync_host_bytes"],
        "vllm_sync_dlpack_tensors": slowest_sync["sync_dlpack_tensors"],
        "vllm_step_sample_s": step_s,
    }


def _block(prompts: int, process_id: int, count: int) -> int:
    share = prompt_share(prompts, process_id, count)
    return share.stop - share.start


# ------------------------------------------------------------------------------------------- one worker
def worker_main(workdir: str, parent_pid: int) -> None:
    die_with_parent(parent_pid)
    process_id = int(os.environ["JAX_PROCESS_ID"])
    with open(os.path.join(workdir, "spec.json")) as f:
        spec = json.load(f)
    sharding.initialize_distributed()  # from the JAX_* variables the section set
    try:
        record = run_engine(spec, workdir)
    except BaseException as err:  # recorded for the section, then the worker fails
        write_record(workdir, process_id, {"process": process_id, "error": f"{type(err).__name__}: {err}"[:4000]})
        raise
    write_record(workdir, process_id, record)
    jax.distributed.shutdown()  # with the others: process 0 holds the coordinator


def die_with_parent(parent_pid: int) -> None:
    """A worker left behind by a killed section would hold its GPU through the next section: the kernel ends it
    with the section's process (Linux's ``PR_SET_PDEATHSIG``)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # it went before the call above
        sys.exit("the benchmark's section process is gone")


def write_record(workdir: str, process_id: int, record: dict) -> None:
    with open(record_path(workdir, process_id), "w") as f:
        json.dump(record, f, indent=1)


def log(message: str) -> None:
    # One write per line: the workers share the section's console, and print's separate newline interleaves.
    sys.stdout.write(f"{time.strftime('%H:%M:%S')} [vllm {jax.process_index()}] {message}\n")
    sys.stdout.flush()


def run_engine(spec: dict, workdir: str) -> dict:
    """Steps 1-4 of the module docstring; this engine's record."""
    config = engine_config(spec)
    mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=-1))
    key = jax.random.key(spec["seed"])
    init = jax.jit(init_params, static_argnums=0, out_shardings=sharding.param_shardings(config, mesh))
    params = {"base": init(config, key)["base"]}
    record: dict[str, Any] = {"process": jax.process_index(), "engines": jax.process_count()}
    model_dir = os.path.join(workdir, "model")
    if jax.process_index() == 0:
        record["write_s"] = write_model(model_dir, config, key)
    multihost_utils.sync_global_devices("vllm_layout: model written")
    engine = start_engine(model_dir, config, spec)
    multihost_utils.sync_global_devices("vllm_layout: engines started")
    if jax.process_index() == 0:  # every engine holds the weights now: a killed section leaves no model behind
        shutil.rmtree(model_dir, ignore_errors=True)
    try:
        record.update(engine_facts(engine))
        record.update(time_sync(engine, config, params))
        log(f"full sync {record['sync_s']:.2f} s, {record['sync_host_bytes']} bytes through the host")
        record.update(time_sample(engine, params, spec))
        log(f"{record['tokens']} tokens in {record['seconds']:.1f} s: {record['tokens_per_s']:.0f} tokens/s")
    finally:
        engine.close()
    device = jax.local_devices()[0]
    return {**record, "backend": jax.default_backend(), "jax_device": device.device_kind}


def engine_config(spec: dict) -> ModelConfig:
    """The preset in the spec's dtype, with heads vLLM's attention runs. Its CPU build lacks head_dim 16 (the tiny
    preset's) and its Qwen2 takes head_dim as hidden / heads: there the heads are made 64 wide, and so fewer."""
    config = ModelConfig.preset(spec["preset"], param_dtype=spec["dtype"], compute_dtype=spec["dtype"])
    try:
        check_model(config)
    except ValueError:
        heads = max(1, config.hidden_size // 64)
        config = dataclasses.replace(config, hidden_size=64 * heads, num_heads=heads, head_dim=64,
                                     num_kv_heads=min(heads, config.num_kv_heads))  # fmt: skip
        check_model(config)
    return config


def write_model(model_dir: str, config: ModelConfig, key: jax.Array) -> float:
    """The params of ``key`` as a Hugging Face directory with ``id_tokenizer``; its seconds."""
    start = time.perf_counter()
    base = jax.device_get(jax.jit(init_params, static_argnums=0)(config, key)["base"])
    hf.save_pretrained(model_dir, config, {"base": base})
    id_tokenizer(config).save_pretrained(model_dir)
    return time.perf_counter() - start


def id_tokenizer(config: ModelConfig):
    """A word-level tokenizer with one word, ``<i>``, per id of the model's vocabulary: vLLM loads one from the model
    directory at start, though prompts go in as ids and no text comes out, and with the model's size every id the
    engine samples is one of its tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    word = "<{}>".format
    tok = Tokenizer(models.WordLevel(vocab={word(i): i for i in range(config.vocab_size)}, unk_token=word(0)))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    eos = config.eos_token_id[0] if isinstance(config.eos_token_id, tuple) else config.eos_token_id
    specials = {"bos_token": config.bos_token_id, "eos_token": eos}
    named = {k: word(v) for k, v in specials.items() if v is not None}
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=word(0), unk_token=word(0), **named)


def start_engine(model_dir: str, config: ModelConfig, spec: dict) -> VLLMSampler:
    """The engine as ``rollout.engine: vllm`` builds it (``job/build.py``), warmed up."""
    start = time.perf_counter()
    memory = {"kv_cache_space_gib": 1} if spec["cpu"] else {"gpu_memory_utilization": spec["vllm_fraction"]}
    engine = VLLMSampler(model_dir, config, dtype=spec["dtype"], seed=spec["seed"],
                         max_model_len=spec["prompt_len"] + spec["new_tokens"], **memory)  # fmt: skip
    engine.warmup()
    log(f"engine on {engine.engine_device} started and warmed up in {time.perf_counter() - start:.1f} s")
    return engine


def engine_facts(engine: VLLMSampler) -> dict[str, Any]:
    """The engine's start-up and the tokens its KV cache holds (how many rows decode at once, at full length)."""
    facts = {"engine_device": engine.engine_device, "start_s": engine.stats["start_s"]}
    facts["warmup_s"] = engine.stats["warmup_s"]
    # vLLM's internals, read where this version has them: a figure that explains the throughput, never a failure.
    cache = getattr(getattr(engine.llm.llm_engine, "vllm_config", None), "cache_config", None)
    if getattr(cache, "num_gpu_blocks", None):
        facts["kv_cache_tokens"] = int(cache.num_gpu_blocks) * int(cache.block_size)
    return facts


def time_sync(engine: VLLMSampler, config: ModelConfig, params) -> dict[str, Any]:
    """A full sync from the sharded params, after one that compiles the gathers, slices and casts it runs."""
    first_s = engine.sync_weights(config, params)
    engine.sync_weights(config, params, force=True)
    keys = ("sync_s", "sync_host_bytes", "sync_dlpack_tensors", "sync_host_tensors", "last_sync_tensors")
    return {"sync_first_s": first_s, **{k: engine.stats[k] for k in keys}}


def time_sample(engine: VLLMSampler, params, spec: dict) -> dict[str, Any]:
    """The step's rollouts, this engine's block of them timed at its own generate call."""
    prompts_n, group, new_tokens = spec["prompts"], spec["group"], spec["new_tokens"]
    rng = np.random.default_rng(spec["seed"])  # the same prompts in every process, as the trainer's draw
    # Never the pad id 0; ordinary ids for a real vocabulary.
    prompts = rng.integers(1, min(engine.config.vocab_size, 30000), (prompts_n, spec["prompt_len"])).tolist()
    own_s: list[float] = []
    generate = engine.llm.generate

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = generate(*args, **kwargs)
        own_s.append(time.perf_counter() - start)
        return out

    engine.llm.generate = timed
    start = time.perf_counter()
    batch = engine.generate_arrays(
        params, prompts, key=jax.random.key(spec["seed"]), max_new_tokens=new_tokens, n=group, eos_token_ids=()
    )
    call_s = time.perf_counter() - start
    share = prompt_share(prompts_n, jax.process_index(), jax.process_count())
    lengths = batch.lengths[share.start * group : share.stop * group]
    if not (lengths == new_tokens).all():
        raise RuntimeError(f"rows ended early: lengths {sorted(set(lengths.tolist()))}")
    tokens, seconds = int(lengths.sum()), sum(own_s)
    return {
        "prompts": share.stop - share.start,
        "rows": len(lengths),
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "call_s": call_s,
        "cached_prompt_tokens": engine.stats.get("last_cached_prompt_tokens"),
    }


if __name__ == "__main__":  # vLLM may spawn helper processes, which import this module: the guard keeps them out
    worker_main(sys.argv[1], int(sys.argv[2]))
