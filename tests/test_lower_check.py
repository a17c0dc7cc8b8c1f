"""``tools/lower_check.py`` at its reduced shape: every program a run compiles lowers for ``cuda`` and ``tpu`` on
fsdp 4 x tp 2 (or is skipped with its reason), the kernels are chosen when lowering, and a Pallas block
that only Triton refuses fails exactly the cells that use it."""

from __future__ import annotations

import functools
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from lspo_jax.models import kernels
from lspo_jax.train_config import ConfigError
from tools import lower_check

pytestmark = pytest.mark.slow  # the chips' compilers

ROOT = Path(__file__).resolve().parents[1]
# fsdp 4 x tp 2 splits rows, params and heads as both 8-device meshes do, and a program that lowers sharded also
# lowers on one device (its shardings are trivial there): the suite lowers the grid on that mesh alone (47 cells,
# half the time of adding the one-device grid); the full check covers all three, the invalid-block test below one.
MESHES = ("fsdp4_tp2",)


@pytest.fixture(scope="module")
def tool():
    return lower_check


@pytest.fixture(scope="module")
def shape(tool):
    return tool.small_shape()


@pytest.fixture(scope="module")
def cells(tool, shape):
    return list(tool.check(shape, meshes=MESHES))


def test_every_cell_lowers_or_is_skipped_with_its_reason(tool, cells):
    for cell in cells:
        where = (cell.program, cell.attention, cell.mesh)
        if cell.attention == "cudnn" and cell.program != "l2rr_jvp":  # L2RR's forward mode takes xla for cudnn
            assert cell.status == "skipped" and any(s in cell.reason for s in tool.UNAVAILABLE), (where, cell.reason)
        else:
            assert cell.status == "lowered", (where, cell.platform, cell.reason)
            assert cell.tflop > 0 and "\n" not in cell.reason


def test_the_grid_has_every_program_platform_mesh_and_attention(tool, cells):
    # Per mesh: 7 programs of model.attention x (3 cuda + 2 tpu) and 4 sampler programs x (2 cuda + 1 tpu) = 47.
    assert len(cells) == 47 * len(MESHES)
    got = {(c.program, c.platform, c.mesh, c.attention) for c in cells}
    assert ("rl_packed", "cuda", "fsdp4_tp2", "pallas") in got and ("decode", "cuda", "fsdp4_tp2", "pallas") in got
    assert ("sft", "tpu", "fsdp4_tp2", "splash") in got and ("decode", "tpu", "fsdp4_tp2", "reduce") in got
    assert not any(c.platform == "tpu" and c.attention in ("pallas", "cudnn") for c in cells)
    assert not any(c.platform == "cuda" and c.attention == "splash" for c in cells)


def test_a_kernel_is_chosen_for_the_platform_it_is_lowered_for(tool, shape):
    """One trace of the log-prob pass with ``pallas``: lowered for cuda it holds the Triton call, lowered for the CPU
    the interpreter's plain HLO (the choice is ``lax.platform_dependent``'s, not ``jax.default_backend()``'s)."""
    mesh = tool.abstract_mesh("fsdp4_tp2")
    traced = tool.PROGRAMS["logprobs_base"](shape, tool.model_config(shape, "logprobs_base", "pallas"), mesh)
    triton = f"@{tool.KERNEL_CALLS['pallas']}("
    assert triton in traced.lower(lowering_platforms=("cuda",)).as_text()
    assert triton not in traced.lower(lowering_platforms=("cpu",)).as_text()


def test_a_kl_penalty_puts_the_reference_in_the_log_prob_pass_and_its_log_probs_in_the_update(tool):
    """``loss.kl_coef``: the rollouts' pass takes the frozen reference's weights beside the base's (bfloat16: the recipe
    computes in it, 2 bytes a parameter) and returns their log-probs too; the update's batch carries those."""
    from lspo_jax.models import specs

    mesh = tool.abstract_mesh("fsdp4_tp2")

    def traced(program, *overrides):
        shape = tool.small_shape(overrides=overrides)
        return shape, tool.PROGRAMS[program](shape, tool.model_config(shape, program, "blocked"), mesh).jaxpr

    nbytes = lambda avals: sum(math.prod(a.shape) * a.dtype.itemsize for a in avals)
    shape, off = traced("logprobs_base")
    _, on = traced("logprobs_base", "loss.kl_coef=0.1")
    params = specs.count_params(specs.abstract_params(shape.model)["base"])
    assert nbytes(on.in_avals) - nbytes(off.in_avals) == 2 * params
    assert (len(off.out_avals), len(on.out_avals)) == (1, 2) and on.out_avals[0] == on.out_avals[1]
    (_, rl_off), (_, rl_on) = traced("rl_packed"), traced("rl_packed", "loss.kl_coef=0.1")
    assert len(rl_on.in_avals) == len(rl_off.in_avals) + 1  # ref_logp, [rows, length] float32


def test_the_decode_kernel_splits_into_power_of_two_blocks():
    # 1280 slots (1024 prompt + the first 256-slot window): 16 parts of 80 would be 80-slot blocks, which Triton
    # refuses; 2 parts of 640 are 5 blocks of 128. 9216 = 8 x 1152 = 8 x 9 x 128 (16 x 576 would take 64-slot blocks).
    # 160 slots: no part is a multiple of 128; 2 parts of 80 take 16-slot blocks (80 = 5 x 16).
    cases = {1280: (2, 128), 1536: (4, 128), 2048: (16, 128), 3072: (8, 128), 9216: (8, 128), 160: (2, 16)}
    assert {slots: kernels._decode_split(slots) for slots in cases} == cases


@pytest.fixture
def invalid_backward_block(monkeypatch):
    """The Pallas GPU kernel with 48-slot backward blocks: the interpreter runs them, Triton takes powers of two only.
    Traces are cached per jitted function and arguments, so the caches are cleared on the way in and out."""
    from jax.experimental.pallas.ops.gpu import attention

    blocks = attention.BlockSizes(128, 128, block_q_dkv=48, block_kv_dkv=48, block_q_dq=48, block_kv_dq=48)
    monkeypatch.setattr(attention, "mha", functools.partial(attention.mha, block_sizes=blocks))
    jax.clear_caches()
    yield
    monkeypatch.undo()
    jax.clear_caches()


def test_an_invalid_pallas_block_fails_the_cells_that_use_it(tool, invalid_backward_block, capsys, tmp_path):
    out = tmp_path / "cells.json"
    args = ["--small", "--programs", "rl_packed,logprobs_base", "--meshes", "one", "--platforms", "cuda"]
    assert tool.main([*args, "--attention", "pallas,blocked", "--json", str(out)]) == 1
    status = {(c["program"], c["attention"]): c for c in json.loads(out.read_text())}
    failed = status[("rl_packed", "pallas")]  # the backward kernel: only the update differentiates attention
    assert failed["status"] == "failed" and "power of 2" in failed["reason"]
    assert all(status[cell]["status"] == "lowered" for cell in status if cell != ("rl_packed", "pallas"))
    printed = capsys.readouterr().out
    assert "FAILED: ValueError: The Pallas Triton lowering" in printed and "Traceback" not in printed
    assert "4 cells: 3 lowered, 0 skipped, 1 failed" in printed


# ------------------------------------------------------------------------------------------ compiled for the chips
# Per-device peaks (MiB) of the small shape's programs as compiled with libtpu 0.0.42 and XLA's CUDA backend of
# jaxlib 0.10.2 (measured 2026-12-05: h100x8 SFT step 4.84, decode 1.14; v5e-8 update 7.32), with 25% headroom: a
# layout change that makes a program hold a copy it did not (the decode cache's, a second set of activations) fails
# here. Each target with the kernels meant for it: Triton's through ptxas on the H100 (the SFT step's forward and
# backward, the decode kernel), Mosaic's splash on the TPU (the update's); three programs keep the test near 40 s.
SMALL_PEAK_MIB = {("h100x8", "sft"): 6.1, ("h100x8", "decode"): 1.4, ("v5e-8", "rl_packed"): 9.2}
TARGET_OPTIONS = {
    "h100x8": ("--programs", "sft,decode", "model.attention=pallas", "model.decode_attention=pallas"),
    "v5e-8": ("--programs", "rl_packed", "model.attention=splash"),
}


# Both targets in one process (the chips' plugins load when JAX starts, so not this one): a second start of JAX and
# the plugins costs 4-5 s. Each target's output ends with its exit status on a line of its own.
_COMPILE_EACH = """
import json, sys
from tools import lower_check as tool
for argv in json.loads(sys.argv[1]):
    print(f"exit status {tool.main(argv)}", flush=True)
"""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """The tool's compile mode in a process of its own, per target: its exit status, output and cells."""
    out = tmp_path_factory.mktemp("compiled")
    argvs = [["--small", "--compile", target, "--meshes", "fsdp8", *options, "--json", str(out / f"{target}.json")]
             for target, options in TARGET_OPTIONS.items()]  # fmt: skip
    done = subprocess.run([sys.executable, "-c", _COMPILE_EACH, json.dumps(argvs)], capture_output=True, text=True,
                          cwd=ROOT)  # fmt: skip
    outputs = re.split(r"^exit status (\d+)\n", done.stdout, flags=re.MULTILINE)
    fits = {}
    for i, target in enumerate(TARGET_OPTIONS):
        cells = out / f"{target}.json"
        assert cells.exists() and len(outputs) > 2 * i + 1, done.stdout + done.stderr[-2000:]
        fits[target] = (int(outputs[2 * i + 1]), outputs[2 * i], json.loads(cells.read_text()))
    return fits


def test_the_small_shape_compiles_for_an_h100_and_a_tpu_within_its_bounds(compiled):
    for target, (code, printed, cells) in compiled.items():
        assert code == 0, printed
        assert {(target, c["program"]) for c in cells} == {key for key in SMALL_PEAK_MIB if key[0] == target}
        for cell in cells:
            where = (target, cell["program"], cell["attention"], cell["mesh"])
            assert cell["fits"] and "error" not in cell and cell["mesh"] == "fsdp8", (where, cell.get("error"))
            assert 0 < cell["peak_gib"] * 1024 <= SMALL_PEAK_MIB[target, cell["program"]], (where, cell["peak_gib"])
        assert f"{len(cells)} cells: {len(cells)} fit, 0 do not fit or failed" in printed


def test_a_split_compiles_the_learners_programs_on_its_devices_and_the_rollouts_on_the_others(tmp_path):
    """``--splits 4+4``: the old-log-prob pass on the learner's 4 devices, the decode step on the sampler's 4, each
    against a device's budget; a split that does not add up to the target's 8 devices is a failed cell, not a
    silent nothing."""
    argvs = [["--small", "--compile", "h100x8", "--splits", splits, "--programs", "logprobs_base,decode",
              "--json", str(tmp_path / f"{i}.json")] for i, splits in enumerate(["4+4", "2+2"])]  # fmt: skip
    done = subprocess.run([sys.executable, "-c", _COMPILE_EACH, json.dumps(argvs)], capture_output=True, text=True,
                          cwd=ROOT)  # fmt: skip
    assert re.findall(r"^exit status (\d+)$", done.stdout, flags=re.MULTILINE) == ["0", "1"], done.stderr[-2000:]
    cells = {c["program"]: c for c in json.loads((tmp_path / "0.json").read_text())}
    assert {name: c["mesh"] for name, c in cells.items()} == {"logprobs_base": "4+4 learn", "decode": "4+4 sample"}
    assert all(c["fits"] and c["peak_gib"] > 0 for c in cells.values())
    [bad] = json.loads((tmp_path / "1.json").read_text())
    assert bad["error"] == "--splits 2+2: none adds up to its 8 devices" and not bad["fits"]


def test_splits_are_two_positive_counts(tool, capsys):
    for argv in (["--small", "--splits", "4+4"], ["--small", "--compile", "h100x8", "--splits", "4+4", "--meshes",
                                                  "fsdp8"]):  # fmt: skip
        assert tool.main(argv) == 2
        assert capsys.readouterr().err.startswith("lower_check: --splits is a layout of --compile's targets")
    assert tool.parse_splits("4+4,2+6") == [(4, 4), (2, 6)] and tool.parse_splits(None) is None
    for bad in ("4+0", "4", "4+4,x", "4-4"):
        with pytest.raises(ConfigError, match="^--splits '"):
            tool.parse_splits(bad)


def test_an_h100_budget_is_its_memory_times_the_runs_allocator_share(tool, compiled):
    # The shipped target config's 84,942,979,072 bytes are 79.11 GiB; the jax engine's default share 0.9.
    assert tool.h100_memory_gib() == pytest.approx(79.11, abs=0.01)
    assert [c["budget_gib"] for c in compiled["h100x8"][2]] == pytest.approx([79.11 * 0.9] * 2, abs=0.01)
    run = tool.load_config(tool.RECIPE, ["rollout.engine=vllm"])
    assert tool.TARGETS["h100x8"].budget_gib(run) == pytest.approx(79.11 * 0.6, abs=0.01)
    assert [c["budget_gib"] for c in compiled["v5e-8"][2]] == [15.75]  # what libtpu 0.0.42 enforces on a v5e chip


def test_a_tpu_refusal_is_read_as_what_the_program_needs_and_what_the_chip_has(tool):
    # libtpu 0.0.42's words for the paper's SFT step (einsum attention) on a v6e chip, as it printed them here.
    words = "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (41.77G) "
    words += "exceeds available HBM (31.25G)."
    assert tool.refusal(RuntimeError(words)) == pytest.approx((41.77, 31.25))
    assert tool.refusal(RuntimeError(words.replace("(41.77G)", "(512.00M)"))) == pytest.approx((0.5, 31.25))
    assert tool.refusal(RuntimeError("INTERNAL: ptxas exited with non-zero error code")) is None


def test_an_unknown_target_is_refused_in_one_line(tool, capsys):
    assert tool.main(["--small", "--compile", "h100x8,tpu9"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"lower_check: unknown target(s) ['tpu9']; choose from {list(tool.TARGETS)}"
    )


def test_compile_without_the_compile_extra_is_one_line(tool, tmp_path, monkeypatch, capsys):
    import importlib.util

    import jaxlib

    # As without the extra: no chips folder, no libtpu, and no jax_plugins package at all.
    find_spec = importlib.util.find_spec

    def without_the_extra(name, *args, **kwargs):
        if name == "libtpu":
            return None
        if name.startswith("jax_plugins."):  # a module under a package that is not there: importlib raises
            raise ModuleNotFoundError("No module named 'jax_plugins'", name="jax_plugins")
        return find_spec(name, *args, **kwargs)

    monkeypatch.setattr(tool, "COMPILE_JAXLIB", jaxlib.__version__)
    monkeypatch.setattr(tool, "CHIPS", tmp_path / "chips")
    monkeypatch.setattr(importlib.util, "find_spec", without_the_extra)
    platforms = jax.config.jax_platforms
    assert tool.main(["--small", "--compile", "h100x8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lower_check: --compile needs ['libtpu', 'jax_plugins.xla_cuda12']: bash tools/setup.sh test")
    assert err.count("\n") == 1
    assert jax.config.jax_platforms == platforms  # JAX's platform is left as it was
