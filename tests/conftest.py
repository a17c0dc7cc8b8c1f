"""Shared fixtures: tiny random transformers Qwen2 checkpoints (tied and untied) with a character tokenizer.

Everything here is session-scoped: building and saving a model costs a second, and the tests only read.
"""

from __future__ import annotations

import os
import string
import tempfile

import numpy as np
import pytest

# The Rust tokenizer would otherwise warn about forking after use when a test spawns worker processes.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Example stores and compiled programs go to a directory of the test run's own, not the user's cache: one for both
# xdist workers (they share the run's id) and every subprocess test, which inherit it. A program that one worker or
# subprocess compiled, another with the same program reads back instead of compiling it again.
_RUN_ID = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"{os.getpid()}"
os.environ.setdefault("LSPO_JAX_CACHE", os.path.join(tempfile.gettempdir(), f"lspo_jax_test_cache_{_RUN_ID}"))


def _fast_cpu_compiles() -> None:
    """The suite compiles many tiny XLA programs; on CPU, LLVM's optimisation of them costs more than
    running them. Level 0 halves compile time and leaves floating-point semantics alone (no fast-math).
    XLA reads the flag when the backend starts, so setting it before any test touches JAX is enough."""
    flags = os.environ.get("XLA_FLAGS", "")
    if not os.path.exists("/dev/nvidia0") and "xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level=0".strip()


_fast_cpu_compiles()


def _shared_compile_cache() -> None:
    """The run's compile cache in this process too (before any test compiles: JAX decides once), keeping programs
    that took 0.02 s or more to compile: tests/test_train.py alone took 175 s keeping those of 0.2 s or more and 157 s
    keeping those of 0.02 s (each Run jits its closures anew, so a repeated shape compiles again without the cache);
    the thousands of smaller programs cost about as much to write as to compile."""
    import jax

    from lspo_jax import compiles

    if compiles.use_cache("default") is not None:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.02)


_shared_compile_cache()


# float32 results differ between x86 builds (AVX2 or AVX-512 kernels, another tiling of a matmul sums in another
# order), so a quantity that passes through matmuls, softmax, layers or a backward pass is compared over the whole
# tensor: an element that cancels to near zero keeps no relative precision, and a per-element tolerance on it
# fails on some CPU. Over the whole tensor, the tiny models' logits and log-probs move by <= 9e-7 of their norm
# between kernels and orderings, gradients by <= 1.2e-6 (measured across XLA's CPU kernels, ISA levels and
# optimisation levels): the tests allow 2e-5 and 1e-4, while a real bug (a transposed weight, a position off
# by one, a missing mask) moves the random models' outputs by O(1) of their scale.
def relative_error(actual, desired) -> float:
    """``||actual - desired|| / ||desired||``: Frobenius norms over every element, in float64."""
    a, d = np.asarray(actual, np.float64), np.asarray(desired, np.float64)
    assert a.shape == d.shape, (a.shape, d.shape)
    diff = np.linalg.norm(a - d)
    return 0.0 if diff == 0 else float(diff / np.linalg.norm(d))  # NaN fails any bound, as it should


def assert_close_relative(actual, desired, rel: float, err_msg: str = "") -> None:
    """Assert ``||actual - desired|| <= rel * ||desired||`` over the whole array (see above for why)."""
    error = relative_error(actual, desired)
    if not error <= rel:
        a, d = np.asarray(actual, np.float64), np.asarray(desired, np.float64)
        raise AssertionError(
            f"{err_msg + ': ' if err_msg else ''}relative error {error:.3g} > {rel:g} "
            f"(max abs difference {np.abs(a - d).max():.3g}, max abs value {np.abs(d).max():.3g}, shape {d.shape})"
        )


# The files whose module fixtures take minutes (8-device checks, vLLM engines, the GPU script's smoke run, whole
# training runs, the paper's recipe), run first: under `pytest -n 2 --dist loadfile` (tools/test.sh) they then
# overlap instead of one of them finishing alone at the end while the other worker idles.
SLOW_FILES_FIRST = (
    "test_sharding.py",
    "test_packing.py",
    "test_vllm.py",
    "test_gpu_bench.py",
    "test_train.py",
    "test_multiprocess.py",
    "test_recipe.py",
)


def pytest_collection_modifyitems(items) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order within a file is kept


# Tiny but structurally complete: GQA (4 query heads over 2 KV heads), head_dim 16, q/k/v biases.
TINY_HF_KWARGS = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    # A small theta makes rotary angles change fast, so a position off by one changes the logits.
    rope_theta=100.0,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
CHARS = string.digits + string.ascii_letters + " +-*/=().,?!:<>{}\\^_"


def build_char_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` (ids 0-3 are pad, bos, eos, unk)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(CHARS))}
    assert len(vocab) <= TINY_HF_KWARGS["vocab_size"]
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # concatenate characters back without spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def _randomize(model, seed: int) -> None:
    """Re-draw every weight with a larger spread than HF's std-0.02 init, so logits are O(1) and a layout
    bug (a transpose, a swapped rotary half) moves them far beyond the comparison tolerance."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.15 * noise)


def build_hf_model(path: str, *, tied: bool, seed: int = 0) -> str:
    """Save a random float32 ``Qwen2ForCausalLM`` plus the character tokenizer into ``path``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(**TINY_HF_KWARGS, tie_word_embeddings=tied)
    model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    _randomize(model, seed)
    model.save_pretrained(path)
    build_char_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def char_tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="session")
def hf_untied_dir(tmp_path_factory) -> str:
    return build_hf_model(str(tmp_path_factory.mktemp("qwen2_untied")), tied=False, seed=0)


@pytest.fixture(scope="session")
def hf_tied_dir(tmp_path_factory) -> str:
    return build_hf_model(str(tmp_path_factory.mktemp("qwen2_tied")), tied=True, seed=1)


@pytest.fixture(scope="session", params=["untied", "tied"])
def hf_model_dir(request) -> str:
    """Each tiny HF checkpoint in turn (parametrises a test over untied and tied embeddings)."""
    return request.getfixturevalue(f"hf_{request.param}_dir")


@pytest.fixture(scope="session")
def tiny_config():
    from lspo_jax.config import ModelConfig

    return ModelConfig.preset("tiny")


@pytest.fixture(scope="session")
def tiny_params(tiny_config):
    """Random ``{"base", "lora"}`` params of the tiny preset, laid out by ``abstract_params``.

    Drawn with numpy (no per-shape XLA compile of the JAX PRNG) and wider than ``init_params`` (std 0.15,
    random norms and biases) so logits are O(1); LoRA B is non-zero: a fresh adapter has B = 0, which
    would hide a wrong adapter formula in any test.
    """
    import jax
    import jax.numpy as jnp

    from lspo_jax.model import abstract_params

    rng = np.random.default_rng(0)

    def draw(path, leaf):
        name = jax.tree_util.keystr(path)
        noise = rng.standard_normal(leaf.shape).astype(np.float32)
        if "norm" in name:
            return jnp.asarray(1.0 + 0.1 * noise)
        return jnp.asarray((0.05 if "lora" in name else 0.15) * noise)

    return jax.tree_util.tree_map_with_path(draw, abstract_params(tiny_config))


@pytest.fixture(scope="session")
def left_padded_batch():
    """``(tokens [3, 10], mask [3, 10])``: row 0 full, rows 1-2 left-padded by 3 and 7; pad id 0."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(4, TINY_HF_KWARGS["vocab_size"], size=(3, 10)).astype(np.int32)
    mask = np.ones((3, 10), np.int32)
    mask[1, :3] = 0
    mask[2, :7] = 0
    tokens[mask == 0] = 0
    return tokens, mask
