"""Reading run configs: the shipped YAML and the defaults load, errors name the dotted key, overrides
apply on top of the file, and ``to_dict`` reads back to an equal config."""

import os
import re
from pathlib import Path

import pytest
import yaml

from lspo_jax.job.config import RunConfig, load_config
from lspo_jax.job.config_io import from_dict, to_dict
from lspo_jax.methods.l2rr.config import score_micro_batches, target_micro_batches
from lspo_jax.tasks import benchmarks, toy
from lspo_jax.train_config import ConfigError

DEMO = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"


def test_defaults_are_the_papers_recipe():
    config = load_config(None)
    assert config == RunConfig()
    assert (config.rollout.prompts_per_step, config.rollout.group_size, config.rollout.max_new_tokens) == (32, 16, 8192)
    assert (config.loss.eps_low, config.loss.eps_high, config.loss.clip_c) == (0.2, 0.28, None)
    assert (config.optim.lr, config.scaffold.sft.lr, config.scaffold.sft_steps) == (1e-6, 2.5e-5, 4)
    assert (config.model.lora.rank, config.model.lora.alpha) == (16, 64.0)
    assert config.scaffold.enabled and config.model.path == "toy"
    assert (config.rollout.engine, config.rollout.vllm_kv_cache_gib) == ("jax", 1)
    assert (config.rollout.compact_every, config.model.decode_attention) == (16, "reduce")


def test_demo_config_loads():
    config = load_config(DEMO)
    assert config.model.path == "toy" and config.data.train == "toy:addition"
    assert (config.rollout.prompts_per_step, config.rollout.group_size, config.scaffold.sft_steps) == (16, 8, 8)
    assert config.eval.ks == (1, 4) and config.model.lora.rank == 16
    assert config.optim.lr == 1e-4 and isinstance(config.model.lora.alpha, float)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("stepz=3", "stepz"),  # unknown, top level
        ("rollout.groupsize=4", "rollout.groupsize"),  # unknown, nested
        ("model.lora.rnk=4", "model.lora.rnk"),  # unknown, two levels down
        ("rollout.group_size=sixteen", "rollout.group_size"),  # wrong type
        ("steps=true", "steps"),  # a bool is not an int
        ("eval.ks=[1, two]", "eval.ks[1]"),
        ("rollout=8", "rollout"),  # a value where a section belongs
        ("rollout.group_size.x=3", "rollout.group_size.x"),  # a section where a value belongs
        ("rollout.group_size=1", "rollout.group_size"),  # the right type, refused by the section's check
        ("data.format=csv", "data.format"),
        ("data.instruction_position=middle", "data.instruction_position"),
        ("data.solution_field=answer", "data.solution_field"),
        ("eval.n=0", "eval.n"),
        ("rollout.engine=sglang", "rollout.engine"),
        ("rollout.vllm_kv_cache_gib=0", "rollout.vllm_kv_cache_gib"),
        ("rollout.compact_every=-1", "rollout.compact_every"),
        ("rollout.max_draw_rounds=0", "rollout.max_draw_rounds"),
        ("model.decode_attention=flash", "model.decode_attention"),
        ("loss.advantage=rloo", "loss.advantage"),
        ("loss.tis_cap=0", "loss.tis_cap"),
        ("scaffold.splice=swap", "scaffold.splice"),
        ("scaffold.correction=ratio", "scaffold.correction"),
        ("scaffold.is_cap=0", "scaffold.is_cap"),
        ("scaffold.reroll_n=0", "scaffold.reroll_n"),
        ("scaffold.reroll_temperature=0", "scaffold.reroll_temperature"),
        ("scaffold.reroll_scale=-1", "scaffold.reroll_scale"),
        ("scaffold.cliff_max_successes=8", "scaffold.cliff_max_successes"),  # the demo's K: every group a cliff
        ("first_mistake.teacher_temperature=-1", "first_mistake.teacher_temperature"),
        ("scaffold.adapter=kept", "scaffold.adapter"),
        ("scaffold.supervise=lora", "scaffold.supervise"),
        ("scaffold.reset_every=3", "scaffold.reset_every"),  # a fresh adapter is reset every step already
        ("scaffold.reset_every=0", "scaffold.reset_every"),
        ("optim.mini_batches=129", "optim.mini_batches"),  # the demo's step has 16 x 8 = 128 rows
        ("optim.epochs=0", "optim.epochs"),
    ],
)
def test_bad_keys_and_values_name_the_dotted_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, [override])
    assert str(err.value).startswith(f"{key}:")


def test_unknown_key_in_a_file_is_named(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  groupsize: 4\n")
    with pytest.raises(ConfigError, match=r"^rollout\.groupsize: unknown key"):
        load_config(path)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="an override is written dotted.key=value"):
        load_config(None, ["rollout.group_size"])


def test_a_renamed_key_is_read_under_its_new_name():
    # A run's own config.yaml from before the rename still resumes as it was written.
    assert load_config(None, ["first_mistake.temperature=0.0"]).first_mistake.teacher_temperature == 0.0
    with pytest.raises(ConfigError, match=r"^first_mistake\.temperature: renamed first_mistake\.teacher_temperature"):
        load_config(None, ["first_mistake.temperature=0.0", "first_mistake.teacher_temperature=0.6"])


def test_the_options_default_to_the_papers_method():
    loss, scaffold = RunConfig().loss, RunConfig().scaffold
    assert (loss.advantage, loss.tis_cap) == ("std", None)
    assert (scaffold.splice, scaffold.correction, scaffold.reroll_n, scaffold.reroll_temperature) == (
        "partial", "token", None, None)  # fmt: skip
    assert (scaffold.reroll_scale, scaffold.cliff_max_successes, scaffold.adapter, scaffold.reset_every) == (
        1.0, 0, "fresh", None)  # fmt: skip
    assert (RunConfig().optim.mini_batches, RunConfig().optim.epochs) == (1, 1)


def test_check_of_a_nested_optimizer_config_names_its_section():
    with pytest.raises(ConfigError, match=r"^optim\.lr: must be positive, got -1\.0$"):
        load_config(None, ["optim.lr=-1"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("l2rr.a=0.0", "l2rr.a: must be positive, got 0.0"),
        ("scaffold.sft_steps=0", "scaffold.sft_steps: must be positive, got 0"),
        ("first_mistake.lam=-1.0", "first_mistake.lam: must be a finite number >= 0, got -1.0"),
        ("optim.mini_batches=0", "optim.mini_batches: must be positive, got 0"),
        ("model.lora.rank=0", "model.lora.rank: must be a positive int, got 0"),
    ],
)
def test_a_config_mistake_is_said_one_way(override, message):
    """Whichever check refuses it (a section's, a nested dataclass's, a method's config), a mistake reads the same:
    the dotted key as typed, what is allowed, the value given, on one line."""
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert str(err.value) == message


def test_dotted_overrides_apply_over_the_file():
    config = load_config(
        DEMO,
        ["rollout.group_size=4", "eval.ks=[1, 2]", "loss.clip_c=3", "model.lora.rank=8", "scaffold.enabled=false",
         "data.train=/data/deepmath.jsonl", "optim.lr=1"],
    )  # fmt: skip
    assert config.rollout.group_size == 4 and config.rollout.prompts_per_step == 16  # the file's value stays
    assert config.eval.ks == (1, 2) and config.model.lora.rank == 8 and config.model.lora.alpha == 64.0
    assert config.loss.clip_c == 3.0 and isinstance(config.loss.clip_c, float)  # YAML's int accepted for float
    assert config.optim.lr == 1.0 and isinstance(config.optim.lr, float)
    assert not config.scaffold.enabled and config.data.train == "/data/deepmath.jsonl"


def test_to_dict_round_trips(tmp_path):
    for config in (RunConfig(), load_config(DEMO, ["eval.benchmarks=[a.jsonl, b.jsonl]", "loss.clip_c=3"])):
        assert from_dict(RunConfig, to_dict(config)) == config
        path = tmp_path / "config.yaml"  # the way a run writes its config.yaml
        path.write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
        assert load_config(path) == config


def test_paper_recipes_differ_only_in_the_scaffold():
    configs = DEMO.parent
    lspo = load_config(configs / "lspo_deepmath_r1_distill_qwen_1p5b.yaml")
    dapo = load_config(configs / "dapo_deepmath_r1_distill_qwen_1p5b.yaml")
    assert lspo.scaffold.enabled and not dapo.scaffold.enabled
    assert to_dict(lspo) | {"scaffold": None} == to_dict(dapo) | {"scaffold": None}
    # The paper's DAPO recipe: 32 x 16, lr 1e-6, eps 0.2 / 0.28, 8192 tokens, buffer 1024, LoRA 16 / 64,
    # 4 SFT steps at 2.5e-5, validation every 10 steps, 1500 steps, seed 42.
    assert (lspo.rollout.prompts_per_step, lspo.rollout.group_size, lspo.rollout.max_new_tokens) == (32, 16, 8192)
    assert (lspo.optim.lr, lspo.loss.eps_low, lspo.loss.eps_high, lspo.reward.overlong_buffer) == (
        1e-6,
        0.2,
        0.28,
        1024,
    )
    assert (lspo.model.lora.rank, lspo.model.lora.alpha, lspo.scaffold.sft_steps, lspo.scaffold.sft.lr) == (
        16,
        64,
        4,
        2.5e-5,
    )
    assert (lspo.eval.every, lspo.steps, lspo.seed) == (10, 1500, 42)
    # R1's prompt: the instruction after the question; validation on MATH500 and AIME 2024-2026, one record each.
    assert (lspo.data.instruction_position, lspo.data.solution_field) == ("after", "r1_solution_1")
    assert lspo.eval.benchmarks == ("math500", "aime24", "aime25", "aime26") and lspo.eval.ks == (1, 4, 8, 16)


def test_memory_settings_of_the_paper_recipe_and_their_checks():
    lspo = load_config(DEMO.parent / "lspo_deepmath_r1_distill_qwen_1p5b.yaml")
    assert (lspo.model.remat, lspo.model.attention, lspo.loss.packing) == ("dots", "blocked", True)
    assert (lspo.loss.micro_batches, lspo.loss.chunk_size) == (32, 1024)
    with pytest.raises(ConfigError, match=r"^model\.remat"):
        load_config(None, ["model.remat=sometimes"])
    with pytest.raises(ConfigError, match=r"^model\.attention: must be one of"):
        load_config(None, ["model.attention=flash"])
    with pytest.raises(ConfigError, match=r"^model\.attention: cudnn needs model\.compute_dtype: bfloat16"):
        load_config(None, ["model.attention=cudnn"])
    assert load_config(None, ["model.attention=cudnn", "model.compute_dtype=bfloat16"]).model.attention == "cudnn"
    with pytest.raises(ConfigError, match=r"^loss\.chunk_size"):
        load_config(None, ["loss.chunk_size=0"])


def test_mesh_section_errors_name_the_key():
    assert load_config(None, ["mesh.fsdp=4", "mesh.tp=2"]).mesh.tp == 2
    with pytest.raises(ConfigError, match=r"mesh\.fsdp"):
        load_config(None, ["mesh.fsdp=0"])
    with pytest.raises(ConfigError, match=r"mesh\.enabled"):
        load_config(None, ["mesh.enabled=sometimes"])


def test_a_config_laid_over_its_base_config(tmp_path):
    (tmp_path / "base.yaml").write_text("rollout: {group_size: 16, temperature: 0.7}\nsteps: 9\n")
    (tmp_path / "chip.yaml").write_text("base_config: base.yaml\nrollout: {group_size: 4}\n")
    run = load_config(tmp_path / "chip.yaml", ["steps=3"])
    # The section merged key by key: its own group size, the base's temperature; the override over both.
    assert (run.rollout.group_size, run.rollout.temperature, run.steps) == (4, 0.7, 3)
    (tmp_path / "loop.yaml").write_text("base_config: loop.yaml\n")
    with pytest.raises(ConfigError, match=r"loop\.yaml: base_config: loop\.yaml is already being read"):
        load_config(tmp_path / "loop.yaml")
    (tmp_path / "lost.yaml").write_text("base_config: nowhere.yaml\n")
    with pytest.raises(ConfigError, match=r"config file not found: .*nowhere\.yaml"):
        load_config(tmp_path / "lost.yaml")


def test_the_device_memory_split_between_jax_and_vllm():
    # Alone JAX takes 0.9 of each GPU; beside vLLM 0.6, and vLLM 1 - 0.6 - 0.05 = 0.35; one setting moves both.
    assert load_config(None).mesh.memory_fractions("jax") == (0.9, 0.0)
    assert load_config(None).mesh.memory_fractions("vllm") == (0.6, 0.35)
    assert load_config(None, ["mesh.memory_fraction=0.5"]).mesh.memory_fractions("vllm") == (0.5, 0.45)
    with pytest.raises(ConfigError, match=r"^mesh\.memory_fraction: must be null or between 0\.05 and 0\.98, got 1\.5"):
        load_config(None, ["mesh.memory_fraction=1.5"])


def test_l2rr_micro_batches_follow_the_updates_tokens_unless_set():
    recipe = DEMO.parent / "lspo_deepmath_r1_distill_qwen_1p5b.yaml"
    run = load_config(recipe, ["l2rr.enabled=true", "l2rr.target=math500"])
    # 32 x 16 rows in 32 micro-batches: 16 rows of 1024 + 8192 slots a micro-batch. The scores take whole groups
    # of 16: 32 chunks of one prompt. Target rows are 1024 + 8192 slots too: 16 a chunk, 64 rows in 4.
    assert (run.update_rows_per_micro(), score_micro_batches(run), target_micro_batches(run, 64)) == (16, 32, 4)
    # Target rows of 1024 + 2048 slots hold 16 x 9216 / 3072 = 48 a chunk: 64 rows in 2; 48 rows in 1.
    short = load_config(recipe, ["data.max_solution_tokens=2048"])
    assert (target_micro_batches(short, 64), target_micro_batches(short, 48)) == (2, 1)
    # 8 micro-batches of 64 rows: 4 groups a chunk, 8 chunks. 12 prompts in 4 micro-batches of 48 rows: 3 groups
    # a chunk, 4 chunks. 10 prompts in 4 micro-batches of 40 rows: at most 2 groups a chunk, and 10 / 2 = 5 chunks.
    assert score_micro_batches(load_config(recipe, ["loss.micro_batches=8"])) == 8
    assert score_micro_batches(load_config(recipe, ["rollout.prompts_per_step=12", "loss.micro_batches=4"])) == 4
    assert score_micro_batches(load_config(recipe, ["rollout.prompts_per_step=10", "loss.micro_batches=4"])) == 5
    set_by_hand = load_config(recipe, ["l2rr.score_micro_batches=2", "l2rr.target_micro_batches=3"])
    assert (score_micro_batches(set_by_hand), target_micro_batches(set_by_hand, 64)) == (2, 3)


def test_option_sections_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"l2rr.*target"):
        load_config(None, ["l2rr.enabled=true"])
    with pytest.raises(ConfigError, match=r"l2rr\.g_min"):
        load_config(None, ["rollout.group_size=4", "l2rr.g_min=5"])
    with pytest.raises(ConfigError, match=r"first_mistake.*lam"):
        load_config(None, ["first_mistake.lam=-1"])
    with pytest.raises(ConfigError, match=r"data\.limit"):
        load_config(None, ["data.limit=0"])


def _option_fields():
    """(section, field, option type) of every field of RunConfig's sections typed as one of ``options``' options."""
    import dataclasses
    import typing

    for section in dataclasses.fields(RunConfig):
        cls = typing.get_type_hints(RunConfig)[section.name]
        if dataclasses.is_dataclass(cls):
            for name, hint in typing.get_type_hints(cls).items():
                if typing.get_origin(hint) is typing.Literal:
                    yield section.name, name, hint


def test_every_option_is_typed_and_checked_one_way_from_yaml_and_from_python():
    import dataclasses

    from lspo_jax import options

    found = list(_option_fields())
    # The axes the method's variants turn on are typed options, not free strings (11 sections' fields in all).
    assert {(s, n) for s, n, _ in found} >= {("loss", "advantage"), ("scaffold", "splice"),
                                             ("scaffold", "correction"), ("scaffold", "adapter"),
                                             ("rollout", "engine"), ("first_mistake", "reference")}  # fmt: skip
    for section, name, option in found:
        known = options.choices(option)
        message = "^" + re.escape(f"{section}.{name}: must be one of {known!r}, got 'bogus'") + "$"
        with pytest.raises(ConfigError, match=message):  # from YAML, the reader's check
            load_config(None, [f"{section}.{name}=bogus"])
        defaults = getattr(RunConfig(), section)
        with pytest.raises(ConfigError, match=message):  # built in Python, the section's own check
            dataclasses.replace(defaults, **{name: "bogus"})
        for value in known:  # every declared value passes the option's check (a rule on a pair may still refuse it)
            try:
                load_config(None, [f"{section}.{name}={value}"])
            except ConfigError as err:
                assert "must be one of" not in str(err), (section, name, value)


def test_each_strategy_option_has_exactly_its_values_registered_and_one_lookup():
    from lspo_jax import options
    from lspo_jax.job import run
    from lspo_jax.models import attention
    from lspo_jax.rl import corrections, losses, optim, scaffold, supervise

    registries = {
        "rollout.engine": run.ENGINES,
        "model.attention": attention.ATTENTIONS,
        "model.decode_attention": attention.DECODE_ATTENTIONS,
        "loss.advantage": losses.ESTIMATORS,
        "loss.kl_estimator": losses.KL_ESTIMATORS,
        "optim.schedule": optim.LR_SCHEDULES,
        "scaffold.splice": scaffold.SPLICE_VARIANTS,
        "scaffold.correction": corrections.CORRECTIONS,
        "scaffold.adapter": options.ADAPTER_LIFETIMES,
        "scaffold.supervise": supervise.SUPERVISORS,
    }
    hints = {f"{s}.{n}": hint for s, n, hint in _option_fields()}
    for key, registry in registries.items():
        assert registry.option is hints[key], key  # the registry is the one of the field's option type
        assert tuple(registry) == options.choices(registry.option), key  # every value, in declaration order
        with pytest.raises(ValueError, match=f"^unknown {registry.what} 'bogus'; known: "):
            registry.resolve("bogus")
        for name, strategy in registry.items():  # resolved once, a strategy passes through as itself
            assert registry.resolve(name) is strategy and registry.resolve(strategy) is strategy, (key, name)
    with pytest.raises(ValueError, match="unknown advantage estimator"):  # not one of its strategies
        losses.ESTIMATORS.resolve(corrections.CORRECTIONS.resolve("token"))
    with pytest.raises(ValueError, match="'rloo' is not a value of its option"):  # a strategy without its name
        losses.ESTIMATORS.register("rloo")(lambda r, valid, eps: r)
    with pytest.raises(ValueError, match="'loo' is registered twice"):
        losses.ESTIMATORS.register("loo")(lambda r, valid, eps: r)


def test_pairs_that_contradict_each_other_name_the_key():
    # Clip-higher: the ratio is clipped to [1 - eps_low, 1 + eps_high] with eps_high >= eps_low (DAPO 0.2 / 0.28).
    with pytest.raises(ConfigError, match=r"^loss\.eps_high: .*got eps_high 0\.1 < eps_low 0\.2$"):
        load_config(None, ["loss.eps_high=0.1"])
    assert load_config(None, ["loss.eps_high=0.2"]).loss.eps_high == 0.2  # symmetric PPO clipping is fine
    # The overlong penalty starts at max_new_tokens - buffer: 64 - 65 < 0 would penalise every response.
    with pytest.raises(ConfigError, match=r"^reward\.overlong_buffer: 65 is more than rollout\.max_new_tokens 64"):
        load_config(DEMO, ["reward.overlong_buffer=65"])
    assert load_config(DEMO, ["reward.overlong_buffer=64"]).reward.overlong_buffer == 64
    assert load_config(DEMO, ["reward.overlong_buffer=65", "reward.overlong_factor=0"]).reward.overlong_factor == 0


def test_every_shipped_config_loads():
    for path in sorted(DEMO.parent.glob("*.yaml")):
        assert load_config(path).steps > 0, path


def test_rollout_compact_every_reaches_the_jax_sampler(monkeypatch):
    from lspo_jax.config import ModelConfig
    from lspo_jax.rollout import generator

    seen = {}
    monkeypatch.setattr(generator, "generate_arrays", lambda *args, **kw: seen.update(kw))
    policy = generator.Policy(config=ModelConfig.preset("tiny"), tokenizer=None, eos_ids=(1,))
    for value, expected in ((0, 0), (None, None)):
        seen.clear()
        sampler = generator.Generator(policy, compact_every=value)
        sampler.generate({}, [[5]], sampler.decoding(4, 1.0, 1.0, 0), key=None)
        assert seen.get("compact_every") == expected  # None: not passed, the sampler's default applies


def test_lspo_train_sets_jaxs_memory_share_from_the_config(monkeypatch, capsys):
    from lspo_jax.job.build import MEMORY_FRACTION_VAR, claim_device_memory

    monkeypatch.delenv(MEMORY_FRACTION_VAR, raising=False)
    vllm = claim_device_memory(load_config(None, ["rollout.engine=vllm"]))
    assert os.environ[MEMORY_FRACTION_VAR] == "0.6" and vllm.mesh.memory_fraction is None
    # A share the user set in the variable is kept when the config leaves it null, and recorded in the config.
    monkeypatch.setenv(MEMORY_FRACTION_VAR, "0.7")
    kept = claim_device_memory(load_config(None, ["rollout.engine=vllm"]))
    assert os.environ[MEMORY_FRACTION_VAR] == "0.7" and kept.mesh.memory_fractions("vllm") == (0.7, 0.25)
    assert capsys.readouterr().err == ""
    # The default itself in the variable (a run before in the same process set it) leaves the config as it was.
    monkeypatch.setenv(MEMORY_FRACTION_VAR, "0.9")
    assert claim_device_memory(load_config(None)) == load_config(None)
    monkeypatch.setenv(MEMORY_FRACTION_VAR, "0.7")
    # An explicit config value wins, with a note.
    claim_device_memory(load_config(None, ["mesh.memory_fraction=0.8"]))
    assert os.environ[MEMORY_FRACTION_VAR] == "0.8"
    assert "mesh.memory_fraction 0.8 replaces XLA_PYTHON_CLIENT_MEM_FRACTION=0.7" in capsys.readouterr().err
    monkeypatch.setenv(MEMORY_FRACTION_VAR, "most")
    with pytest.raises(ConfigError, match="XLA_PYTHON_CLIENT_MEM_FRACTION='most' is not a number"):
        claim_device_memory(load_config(None))


def test_the_v6e_recipe_is_the_papers_but_for_what_fits_its_chips():
    configs = DEMO.parent
    recipe = to_dict(load_config(configs / "lspo_deepmath_r1_distill_qwen_1p5b.yaml"))
    v6e = to_dict(load_config(configs / "lspo_deepmath_r1_distill_qwen_1p5b_v6e8.yaml"))
    changed = lambda run: {
        f"{section}.{key}": value
        for section, fields in run.items()
        if isinstance(fields, dict)
        for key, value in fields.items()
        if recipe[section][key] != value
    }
    assert changed(v6e) == {"model.attention": "splash", "loss.micro_batches": 64, "mesh.fsdp": 8}
    assert {k: v for k, v in v6e.items() if not isinstance(v, dict)} == {
        k: v for k, v in recipe.items() if not isinstance(v, dict)
    }


def test_a_config_file_that_is_not_a_mapping_or_not_text_is_named(tmp_path):
    listed = tmp_path / "listed.yaml"
    listed.write_text("- rollout\n- loss\n")
    with pytest.raises(
        ConfigError, match=r"listed\.yaml: the top level must map section names to settings, got a list"
    ):
        load_config(listed)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"steps: 3\n\xff\xfe")
    with pytest.raises(ConfigError, match=r"binary\.yaml: not UTF-8 text \(byte 9\)"):
        load_config(binary)
    with pytest.raises(ConfigError, match=r"is a directory, not a config file"):
        load_config(tmp_path)
    empty = tmp_path / "empty.yaml"
    for text in ("# nothing set yet\n", "{}\n"):  # would have started the paper's 1.5B shape on whatever model.path is
        empty.write_text(text)
        with pytest.raises(ConfigError, match=r"empty\.yaml: holds no settings \(the defaults alone are the paper's"):
            load_config(empty)


def test_lengths_beyond_the_model_and_a_cache_beyond_the_memory_are_refused_before_anything_runs(monkeypatch):
    import jax

    from lspo_jax.config import ModelConfig
    from lspo_jax.job import build
    from lspo_jax.models import sharding

    tiny = ModelConfig.preset("tiny", compute_dtype="float32")  # 512 positions; 2 layers x 2 KV heads x head_dim 16
    run = load_config(
        None,
        [
            "data.max_prompt_tokens=16",
            "rollout.max_new_tokens=496",
            "eval.max_new_tokens=64",
            "reward.overlong_buffer=4",
        ],
    )
    build.check_positions(run, tiny)  # 16 + 496 = 512: the last position the model has
    with pytest.raises(ConfigError, match=r"rollout\.max_new_tokens = 16 \+ 497 is beyond the model's max_position"):
        build.check_positions(apply(run, "rollout.max_new_tokens=497"), tiny)
    build.check_positions(apply(run, "rollout.max_new_tokens=497"), tiny, train=False)  # lspo-eval: its own
    # The KV cache of a rollout: 16 prompts (a power of two already) x 4 samples = 64 rows of 16 (the smallest
    # prompt bucket) + 496 slots, x 2 (keys, values) x 2 layers x 2 KV heads x 16 dims x 4 bytes (float32)
    # = 32,768 slots x 512 bytes = 16,777,216 bytes; validation's 16 x 16 rows of 16 + 64 slots: 20,480 x 256
    # bytes (per slot: 2 x 2 x 2 x 16 x 4) = 5,242,880.
    run = apply(run, "rollout.prompts_per_step=16", "rollout.group_size=4", "eval.n=16")
    mesh = sharding.local_mesh()
    monkeypatch.setattr(build, "device_memory", lambda mesh: (16_777_216, "here"))
    build.check_cache_fits(run, tiny, mesh)
    monkeypatch.setattr(build, "device_memory", lambda mesh: (16_777_215, "here"))
    with pytest.raises(ConfigError, match=r"rollout\.group_size: 16 prompts x 4 samples of 496 new tokens need a KV "
                                          r"cache of at least 16\.0 MiB, more than the 16\.0 MiB here"):  # fmt: skip
        build.check_cache_fits(run, tiny, mesh)
    monkeypatch.setattr(build, "device_memory", lambda mesh: (5_242_879, "here"))
    with pytest.raises(ConfigError, match=r"rollout\.group_size"):
        build.check_cache_fits(run, tiny, mesh)
    small = apply(run, "rollout.group_size=2", "rollout.max_new_tokens=16")  # 32 rows of 32 slots: 262,144 bytes
    with pytest.raises(ConfigError, match=r"^eval\.n: 16 prompts x 16 samples of 64 new tokens"):
        build.check_cache_fits(small, tiny, mesh)
    assert build.device_memory(mesh)[0] > 2**20 and jax.devices()[0].platform == "cpu"  # the host's, read


def apply(run, *overrides):
    from lspo_jax.job.config_io import apply_overrides, from_dict, to_dict

    return from_dict(RunConfig, apply_overrides(to_dict(run), list(overrides)))


def test_dynamic_sampling_and_l2rr_are_not_both_drawing_the_rounds():
    with pytest.raises(ConfigError, match=r"^rollout\.dynamic_sampling: and l2rr\.enabled both draw the step's rounds"):
        load_config(DEMO, ["rollout.dynamic_sampling=true", "l2rr.enabled=true", "l2rr.target=toy:heldout_2digit"])
    assert load_config(DEMO, ["rollout.dynamic_sampling=true"]).rollout.max_draw_rounds == 4


def test_the_horizon_config_is_the_demo_at_200_steps_with_pass_at_8_and_coverage_at_256():
    horizon, demo = (
        to_dict(load_config(os.path.join(os.path.dirname(DEMO), "demo_horizon.yaml"))),
        to_dict(load_config(DEMO)),
    )
    changed = {(section, key) for section, fields in horizon.items() if isinstance(fields, dict)
               for key, value in fields.items() if demo[section][key] != value}  # fmt: skip
    coverage = {("eval", "coverage_n"), ("eval", "coverage_every"), ("eval", "coverage_benchmarks")}
    assert changed == {("eval", "every"), ("eval", "n"), ("eval", "ks"), ("checkpoint", "every"), *coverage}
    assert horizon["steps"] == 200 and horizon["eval"]["n"] >= 8 and max(horizon["eval"]["ks"]) == 8
    classes = [benchmarks.benchmark_name(spec) for spec in toy.HELDOUT_SPECS]  # the frontier and beyond reach
    assert horizon["eval"]["coverage_n"] == 256 and set(horizon["eval"]["coverage_benchmarks"]) < set(classes)


def test_an_eval_protocol_fills_the_keys_not_named_and_reads_back_the_same(tmp_path):
    path = tmp_path / "dapo.yaml"
    path.write_text("model: {path: toy}\neval: {protocol: dapo}\n")
    dapo = load_config(path).eval
    # DAPO section 4: avg@32 at temperature 1.0, top-p 0.7, 20,480 new tokens; the ks grow to n = 32.
    assert (dapo.n, dapo.temperature, dapo.top_p, dapo.max_new_tokens) == (32, 1.0, 0.7, 20480)
    assert dapo.ks == (1, 4, 8, 16, 32)
    four = load_config(path, ["eval.n=4"]).eval  # a key named wins; the ks follow the n used
    assert (four.n, four.ks, four.top_p, four.max_new_tokens) == (4, (1, 4), 0.7, 20480)
    saved = tmp_path / "config.yaml"  # as a run writes it: every key named, the expanded values
    saved.write_text(yaml.safe_dump(to_dict(load_config(path, ["eval.n=4"]))))
    assert load_config(saved) == load_config(path, ["eval.n=4"])
    # Named by an override, a protocol fills the keys of the file below it too (a resumed run's config.yaml).
    assert load_config(saved, ["eval.protocol=lspo"]).eval.n == 16
    with pytest.raises(ConfigError, match=r"^eval\.protocol: must be one of deepscaler, deepmath, dapo, lspo .*'r1'$"):
        load_config(path, ["eval.protocol=r1"])
    assert load_config(None).eval.top_p is None and load_config(None).eval.protocol is None  # records unchanged


def test_default_ks_fit_n_and_double_up_to_it():
    from lspo_jax.train_config import EvalConfig

    assert EvalConfig.default_ks(16) == [1, 4, 8, 16] == list(EvalConfig().ks)  # the default n: nothing changes
    assert EvalConfig.default_ks(2) == [1, 2] and EvalConfig.default_ks(20) == [1, 4, 8, 16, 20]
    assert EvalConfig.default_ks(256) == [1, 4, 8, 16, 32, 64, 128, 256]


TWICE = "model: {path: toy}\nrollout:\n  group_size: 4\n  temperature: 0.7\nsteps: 3\nrollout:\n  top_k: 5\n"


def test_a_key_given_twice_in_a_file_names_the_key_and_both_lines(tmp_path):
    # YAML readers keep the last of two: the second rollout block would drop group_size 4 without a word.
    path = tmp_path / "twice.yaml"
    path.write_text(TWICE)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}: rollout appears twice (lines 2 and 6)"
    path.write_text("model: {path: toy}\nrollout:\n  group_size: 4\n  temperature: 0.7\n  group_size: 8\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}: rollout.group_size appears twice (lines 3 and 5)"
    path.write_text("model: {path: toy}\nmodel: {lora: {rank: 4, rank: 8}}\n")  # the first repeat is said
    with pytest.raises(ConfigError, match=r"twice\.yaml: model appears twice \(lines 1 and 2\)$"):
        load_config(path)


def test_a_file_laid_over_its_base_config_repeats_no_key(tmp_path):
    (tmp_path / "base.yaml").write_text("rollout: {group_size: 4, temperature: 0.7}\nsteps: 9\n")
    (tmp_path / "chip.yaml").write_text("base_config: base.yaml\nrollout: {group_size: 8}\nsteps: 5\n")
    run = load_config(tmp_path / "chip.yaml")
    assert (run.rollout.group_size, run.rollout.temperature, run.steps) == (8, 0.7, 5)
    (tmp_path / "same.yaml").write_text("base_config: base.yaml\n")  # names nothing of its own: not an empty file
    assert load_config(tmp_path / "same.yaml").rollout.group_size == 4
    (tmp_path / "bad.yaml").write_text("base_config: twice.yaml\nsteps: 5\n")
    (tmp_path / "twice.yaml").write_text(TWICE)  # a base read through another file is checked as well
    with pytest.raises(ConfigError, match=r"twice\.yaml: rollout appears twice \(lines 2 and 6\)$"):
        load_config(tmp_path / "bad.yaml")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optim.lr=inf", "optim.lr: must be finite, got inf"),
        ("reward.overlong_factor=nan", "reward.overlong_factor: must be finite, got nan"),  # no other check reads it
        ("rollout.temperature=.inf", "rollout.temperature: must be finite, got inf"),
        ("eval.temperature=Infinity", "eval.temperature: must be finite, got inf"),  # json.dumps(inf), lspo-eval's
        ("scaffold.reroll_temperature=inf", "scaffold.reroll_temperature: must be finite, got inf"),  # float | None
        ("model.lora.alpha=-inf", "model.lora.alpha: must be finite, got -inf"),
        ("scaffold.sft.lr=NaN", "scaffold.sft.lr: must be finite, got nan"),
        ("reward.timeout_s=1e999", "reward.timeout_s: must be finite, got inf"),
    ],
)
def test_a_float_that_is_not_finite_is_refused_at_its_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, [override])
    assert str(err.value) == message


def test_a_float_that_is_not_finite_in_a_file_is_refused_at_its_key(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("base_config: " + str(DEMO) + "\nreward: {overlong_factor: .nan}\n")
    with pytest.raises(ConfigError, match=r"^reward\.overlong_factor: must be finite, got nan$"):
        load_config(path)
    path.write_text("base_config: " + str(DEMO) + "\nloss: {clip_c: .inf}\n")
    with pytest.raises(ConfigError, match=r"^loss\.clip_c: must be finite, got inf$"):
        load_config(path)


def test_lspo_train_says_a_key_given_twice_on_one_line(tmp_path, capsys):
    from lspo_jax.job.cli import train_main

    path = tmp_path / "twice.yaml"
    path.write_text(TWICE)
    assert train_main(["--config", str(path), "--print-config"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert f"{path}: rollout appears twice (lines 2 and 6)" in captured.err


@pytest.mark.parametrize("seed", ["-1", str(2**32)])
def test_a_seed_no_generator_takes_is_refused_at_its_key(seed):
    with pytest.raises(ConfigError, match=rf"^seed: must be in 0..2\*\*32-1, got {seed}$"):
        load_config(None, [f"seed={seed}"])
