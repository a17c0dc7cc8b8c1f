"""The compile count of a step and the persistent compilation cache (``compiles``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lspo_jax.job import compiles
from lspo_jax.job.config import load_config
from lspo_jax.train_config import ConfigError


def test_a_new_shape_is_one_compile_and_a_repeated_call_none():
    @jax.jit
    def scaled(x):  # defined here: no other test has compiled it
        return jnp.tanh(x) * 3.0 + 1.0

    first = compiles.CompileCount()  # numpy inputs: making them compiles nothing
    scaled(np.ones(5, np.float32)).block_until_ready()
    assert first.since()["compiles"] == 1 and first.since()["time_compile"] > 0
    again = compiles.CompileCount()
    scaled(np.zeros(5, np.float32)).block_until_ready()  # same shape: JAX's in-memory cache
    assert again.since() == {"compiles": 0, "compiles_cached": 0, "time_compile": 0.0}
    scaled(np.zeros(7, np.float32)).block_until_ready()  # a new shape is a new program
    assert again.since()["compiles"] == 1


def test_cache_dir_of_each_setting(monkeypatch, tmp_path):
    monkeypatch.setenv("LSPO_JAX_CACHE", str(tmp_path))
    monkeypatch.delenv(compiles.ENV, raising=False)
    assert compiles.cache_dir("default") == str(tmp_path / "xla")
    monkeypatch.setenv(compiles.ENV, "")  # empty: the default is off
    assert compiles.cache_dir("default") is None
    monkeypatch.setenv(compiles.ENV, str(tmp_path / "elsewhere"))
    assert compiles.cache_dir("default") == str(tmp_path / "elsewhere")
    assert compiles.cache_dir("~/x") == os.path.expanduser("~/x") and compiles.cache_dir(None) is None
    assert load_config(None, ["compile_cache=null"]).compile_cache is None
    with pytest.raises(ConfigError, match=r"^compile_cache"):
        load_config(None, ["compile_cache=' '"])


# A process that turns the cache on, then compiles and runs two programs: the second process of the same script
# must read both back and compile none (JAX decides once per process, so each run is its own process).
SCRIPT = """
import json, sys
import jax, jax.numpy as jnp
from lspo_jax.job import compiles
compiles.use_cache(sys.argv[1])
count = compiles.CompileCount()
jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((8, 8))).block_until_ready()
jax.jit(lambda x: jnp.cumsum(x) * 2)(jnp.ones(16)).block_until_ready()
print(json.dumps(count.since()))
"""


def _run(setting: str) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", SCRIPT, setting], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_process_reads_its_programs_from_the_cache(tmp_path):
    cache = str(tmp_path / "xla")
    first, second = _run(cache), _run(cache)
    # Two jitted programs and the small ones that make their inputs: whatever the first compiled, the second
    # read back, every one of them.
    assert first["compiles"] >= 2 and first["compiles_cached"] == 0
    assert second["compiles"] == 0 and second["compiles_cached"] == first["compiles"]
    assert os.listdir(cache)


def test_a_compile_cache_deleted_mid_run_is_said_once(tmp_path):
    """JAX warns for each program it cannot write to its cache (56 warnings, 112 lines in a short run whose cache
    directory was deleted); the run says it once and compiles on."""
    code = (
        "import shutil, sys, jax, jax.numpy as jnp\n"
        "from lspo_jax.job import compiles\n"
        "compiles.use_cache(sys.argv[1])\n"
        "jax.jit(lambda x: x + 1)(jnp.ones(3))\n"
        "shutil.rmtree(sys.argv[1])\n"
        "with open(sys.argv[1], 'w') as f:\n"  # a file where the directory was: no write can succeed
        "    f.write('')\n"
        "for n in range(2, 6):\n"
        "    print(jax.jit(lambda x: x * n)(jnp.ones(3)).sum())\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "xla")], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["6.0", "9.0", "12.0", "15.0"]  # every program still ran
    told = [line for line in done.stderr.splitlines() if "compile cache" in line or "persistent" in line]
    assert len(told) == 1 and told[0].startswith(f"lspo_jax: the compile cache {tmp_path / 'xla'} cannot be written ")
