"""``tools/compare_arms.py``: the ``--arm`` parser (good and bad), the paired-difference table of three arms on
constructed traces checked by hand, the JSON layout, the refusals before anything trains, a training error in one
line, and reuse, resume and extension to a longer horizon of the run directories. Training is replaced by stand-ins
that write a run's files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lspo_jax.job.config import load_config
from lspo_jax.job.config_io import to_dict
from lspo_jax.train_config import ConfigError
from tools import compare_arms

DEMO = str(Path(__file__).resolve().parents[1] / "configs" / "demo.yaml")

# arm -> seed -> [(step, pass@1, gold_logprob)] of one benchmark, the cliff class; steps 0, 10, 20 (demo: 40 steps).
TRACES = {
    "dapo": {42: [(0, 0.00, -2.000), (10, 0.00, -1.900), (20, 0.00, -1.950)],
             43: [(0, 0.00, -2.100), (10, 0.05, -2.000), (20, 0.00, -1.800)]},
    "lspo": {42: [(0, 0.00, -2.000), (10, 0.10, -1.500), (20, 0.20, -1.200)],
             43: [(0, 0.00, -2.100), (10, 0.05, -1.700), (20, 0.15, -1.400)]},
    "none": {42: [(0, 0.00, -2.000), (10, 0.00, -1.950), (20, 0.05, -1.850)],
             43: [(0, 0.00, -2.100), (10, 0.00, -1.900), (20, 0.00, -2.000)]},
}  # fmt: skip


@pytest.fixture
def tool():
    return compare_arms


@pytest.fixture
def base():
    return load_config(DEMO)


# ------------------------------------------------------------------------------------------------- --arm
def test_arm_parser_good(tool, base):
    assert tool.parse_arm("dapo") == ("dapo", ["scaffold.enabled=false"])
    assert tool.parse_arm("none:scaffold.correction=none") == ("none", ["scaffold.correction=none"])
    # A comma inside brackets belongs to the value: a list override keeps its items.
    assert tool.parse_arm("wide_2:eval.ks=[1,4],scaffold.splice=group,x.y={a: 1, b: 2}") == (
        "wide_2", ["eval.ks=[1,4]", "scaffold.splice=group", "x.y={a: 1, b: 2}"])  # fmt: skip
    # No --arm: the built-in arms, LSPO and DAPO, as the tool always compared them.
    lspo = ["scaffold.enabled=true", "scaffold.supervise=adapter"]
    assert tool.parse_arms([], base) == {"lspo": lspo, "dapo": ["scaffold.enabled=false"]}
    arms = tool.parse_arms(["dapo", "lspo", "none:scaffold.correction=none"], base)
    assert list(arms) == ["dapo", "lspo", "none"] and arms["none"] == ["scaffold.correction=none"]


def test_the_built_in_arms_of_the_field_by_name(tool, base):
    """Each built-in arm makes the config it names; the default set stays LSPO and DAPO. The SFT warm-up's budget
    is given after the arms (the other arms do not read it), and without it the arm is refused in one line."""
    arms = tool.parse_arms(["guide", "shaped", "floor", "direct", "mixed"], base)
    made = {name: tool.cell_config(base, overrides, 42).scaffold for name, overrides in arms.items()}
    assert [made[name].correction for name in ("guide", "shaped", "floor")] == ["guide", "shaped", "floor"]
    assert [made[name].supervise for name in ("guide", "direct", "mixed")] == ["adapter", "base", "mixed"]
    assert all(scaffold.enabled for scaffold in made.values())
    with pytest.raises(ConfigError, match=r"^--arm sft_warmup: scaffold\.warmup_tokens: sft_warmup needs") as err:
        tool.parse_arms(["sft_warmup", "direct"], base)  # no direct arm before it to take the budget from
    assert "\n" not in str(err.value)
    arms = tool.parse_arms(["sft_warmup", "dapo"], base, ["scaffold.warmup_tokens=5000"])
    assert "scaffold.warmup_tokens=5000" not in arms["dapo"]  # the other arms do not read it: not given to them
    warm = tool.cell_config(base, arms["sft_warmup"], 42).scaffold
    assert (warm.supervise, warm.warmup_tokens, warm.uses_cliffs) == ("sft_warmup", 5000, False)
    # SFT then LSPO: the same warm-up budget, then the adapter's scaffold on every step.
    arms = tool.parse_arms(["sft_lspo", "lspo"], base, ["scaffold.warmup_tokens=5000"])
    warm, plain = (tool.cell_config(base, arms[name], 42).scaffold for name in ("sft_lspo", "lspo"))
    assert (warm.enabled, warm.supervise, warm.warmup_tokens, warm.uses_cliffs) == (True, "adapter", 5000, True)
    assert plain.warmup_tokens is None  # plain LSPO does not warm up
    # Without a budget and without a direct arm before it, the arm has nothing to warm up on: LSPO under its name.
    with pytest.raises(ConfigError, match=r"^--arm sft_lspo: .*warm-up budget"):
        tool.parse_arms(["sft_lspo"], base)
    assert list(tool.parse_arms([], base)) == ["lspo", "dapo"]


@pytest.mark.parametrize(
    "item, message",
    [
        (
            "grpo",
            "--arm grpo: not a built-in arm (lspo, dapo, guide, shaped, floor, direct, mixed, sft_warmup, sft_lspo);",
        ),
        (
            "lspo:scaffold.sft_steps=2",
            "lspo is built in (scaffold.enabled=true, scaffold.supervise=adapter); give the variant a new name",
        ),
        ("", "write NAME:key=value,... with NAME"),
        (":scaffold.splice=group", "write NAME:key=value,... with NAME"),
        ("my arm:scaffold.splice=group", "write NAME:key=value,... with NAME"),
        ("x:", "'' is not key=value"),
        ("x:scaffold.splice", "'scaffold.splice' is not key=value"),
        ("x:scaffold.splice=group,,loss.advantage=loo", "'' is not key=value"),
        ("x:=group", "'=group' is not key=value"),
    ],
)
def test_arm_parser_bad(tool, item, message):
    with pytest.raises(ConfigError) as err:
        tool.parse_arm(item)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_warmup_budget_is_what_each_seeds_direct_run_spent(tool, tmp_path, monkeypatch, capsys):
    """Without ``scaffold.warmup_tokens``, ``sft_warmup`` of seed S spends the SFT tokens of ``direct`` seed S's
    train records up to ``steps``; a step past ``steps`` (a longer run reused) and the eval records do not count."""
    spent = {42: [(1, 120), (2, 0), (3, 80), (41, 999)], 43: [(1, 50), (40, 25)]}  # (step, scaffold/sft_tokens)
    calls = []

    def train_run(config, out, resume):
        calls.append((config.scaffold.supervise, config.seed, config.scaffold.warmup_tokens))
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "config.yaml").write_text(yaml.safe_dump(to_dict(config)))
        records = [{"kind": "eval", "step": 0, "benchmark": "cliff", "pass@1": 0.0, "scaffold/sft_tokens": 7}]
        if config.scaffold.supervise == "base":
            records += [{"kind": "train", "step": s, "scaffold/sft_tokens": n} for s, n in spent[config.seed]]
        (Path(out) / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        summary = {"steps": config.steps, "stopped_early": False, "cliff_groups": 0, "surpassed_groups": 0,
                   "surpass_rate": None, "rerolls": 0, "rerolls_passed": 0, "rescue_pass_rate": None}  # fmt: skip
        (Path(out) / "summary.json").write_text(json.dumps(summary))
        return summary

    monkeypatch.setattr(tool, "train_run", train_run)
    argv = ["--config", DEMO, "--seeds", "42", "43", "--out", str(tmp_path), "--arm", "direct", "--arm", "sft_warmup",
            "--arm", "sft_lspo", "eval.ks=[1]"]  # fmt: skip
    assert tool.main(argv) == 0
    # 120 + 0 + 80 = 200 for seed 42 (step 41 is past the demo's 40 steps); 50 + 25 = 75 for seed 43. SFT then LSPO
    # (supervise adapter) takes the same budget as SFT then DAPO.
    assert calls == [("base", 42, None), ("sft_warmup", 42, 200), ("adapter", 42, 200),
                     ("base", 43, None), ("sft_warmup", 43, 75), ("adapter", 43, 75)]  # fmt: skip
    err = capsys.readouterr().err
    assert "compare_arms: sft_warmup seed 43: scaffold.warmup_tokens=75, what direct spent" in err
    assert "compare_arms: sft_lspo seed 43: scaffold.warmup_tokens=75, what direct spent" in err
    training = [line.split(" to step")[0] for line in err.splitlines() if line.startswith("compare_arms: training")]
    assert training == [
        f"compare_arms: training {arm} seed {seed}" for seed in (42, 43) for arm in ("direct", "sft_warmup", "sft_lspo")
    ]
    assert tool.main(argv) == 0 and len(calls) == 6  # reused: the derived budget matches the saved config
    assert "compare_arms: direct seed 42: reusing the run in " in capsys.readouterr().err
    # A warm-up run of another config is refused before anything trains, though its budget is not known yet.
    saved = tmp_path / "sft_warmup_seed43" / "config.yaml"
    saved.write_text(saved.read_text().replace("cliff_max_successes: 0", "cliff_max_successes: 1"))
    assert tool.main(argv) == 2 and len(calls) == 6
    assert "sft_warmup_seed43/config.yaml: a run with scaffold.cliff_max_successes=1" in capsys.readouterr().err
    saved.write_text(saved.read_text().replace("cliff_max_successes: 1", "cliff_max_successes: 0"))
    # The adapter's SFT is not read by SFT then DAPO, whose steps use no cliffs: its run is reused under another
    # sft_steps; SFT then LSPO's, which fits the adapter every step, is refused.
    for arm in ("sft_warmup", "sft_lspo"):
        saved = tmp_path / f"{arm}_seed43" / "config.yaml"
        saved.write_text(saved.read_text().replace("sft_steps: 8", "sft_steps: 3"))
    assert tool.main(argv) == 2 and len(calls) == 6
    err = capsys.readouterr().err
    assert "sft_lspo_seed43/config.yaml: a run with scaffold.sft_steps=3" in err and "sft_warmup_seed43" not in err
    saved.write_text(saved.read_text().replace("sft_steps: 3", "sft_steps: 8"))
    assert tool.main(argv) == 0 and len(calls) == 6
    # A direct run that spent nothing gives no budget: one line, nothing trained.
    spent[44] = [(1, 0)]
    assert tool.main([*argv[:3], "44", *argv[4:]]) == 2
    assert "direct spent no SFT tokens in 40 steps; give scaffold.warmup_tokens" in capsys.readouterr().err
    assert calls[-1] == ("base", 44, None)


def test_arms_are_checked_against_the_config(tool, base):
    with pytest.raises(ConfigError, match=r"^--arm none: scaffold\.corection: unknown key"):
        tool.parse_arms(["dapo", "none:scaffold.corection=none"], base)
    with pytest.raises(ConfigError, match=r"^--arm bad: scaffold\.correction: must be one of"):
        tool.parse_arms(["bad:scaffold.correction=sometimes"], base)
    with pytest.raises(ConfigError, match="^--arm dapo: given twice$"):
        tool.parse_arms(["dapo", "dapo"], base)


def test_a_bad_arm_is_one_line_before_anything_trains(tool, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tool, "train_run", lambda *a, **k: pytest.fail("trained"))
    argv = ["--config", DEMO, "--out", str(tmp_path), "--arm", "dapo", "--arm", "none:scaffold.corection=none"]
    assert tool.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("compare_arms: --arm none: scaffold.corection: unknown key") and err.count("\n") == 1


def test_a_repeated_seed_is_refused_before_anything_trains(tool, tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(tool, "train_run", fake_train_run(calls))
    out = tmp_path / "arms"
    assert tool.main(["--config", DEMO, "--seeds", "42", "43", "42", "--out", str(out)]) == 2
    assert capsys.readouterr().err == "compare_arms: --seeds: 42 given twice; give each seed once\n"
    assert calls == [] and not out.exists()


def test_a_training_error_is_one_line(tool, tmp_path, monkeypatch, capsys):
    def train_run(config, out, resume):
        raise ConfigError(f"data.train: {tmp_path}/gone.parquet does not exist")

    monkeypatch.setattr(tool, "train_run", train_run)
    argv = ["--config", DEMO, "--seeds", "42", "--out", str(tmp_path / "arms")]
    assert tool.main(argv) == 2
    assert (
        capsys.readouterr().err.splitlines()[-1] == f"compare_arms: data.train: {tmp_path}/gone.parquet does not exist"
    )
    # With LSPO_JAX_DEBUG set, the traceback comes before the same line.
    monkeypatch.setenv("LSPO_JAX_DEBUG", "1")
    assert tool.main(argv) == 2
    err = capsys.readouterr().err
    assert err.split("\n", 1)[1].startswith("Traceback") and err.endswith(
        f"\ncompare_arms: data.train: {tmp_path}/gone.parquet does not exist\n"
    )


# ------------------------------------------------------------------------------------- tables and JSON
def fake_train_run(calls: list):
    """A stand-in for ``run.train_run``: writes the run's config, its trace (from ``TRACES``, by the arm its config
    makes) and a finished summary, as a real run leaves them."""

    def train_run(config, out, resume):
        arm = "dapo" if not config.scaffold.enabled else {"token": "lspo", "none": "none"}[config.scaffold.correction]
        calls.append((arm, config.seed, resume))
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "config.yaml").write_text(yaml.safe_dump(to_dict(config)))
        # accuracy (all samples' pass rate) written equal to pass@1: the same peaks, in its own column.
        records = [{"kind": "eval", "step": s, "benchmark": "cliff", "pass@1": p, "accuracy": p, "gold_logprob": g,
                    "gold_logprob_seq": 40 * g} for s, p, g in TRACES[arm][config.seed]]  # fmt: skip
        records.append({"kind": "train", "step": 1, "scaffold_attempted": 2, "surpass_rate": 0.5})
        (Path(out) / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        on = config.scaffold.enabled
        summary = {"steps": config.steps, "stopped_early": False, "cliff_groups": 10, "surpassed_groups": 4 * on,
                   "surpass_rate": 0.4 if on else None, "rerolls": 80 * on, "rerolls_passed": 6 * on,
                   "rescue_pass_rate": 0.075 if on else None}  # fmt: skip
        (Path(out) / "summary.json").write_text(json.dumps(summary))
        return summary

    return train_run


def test_paired_differences_by_hand(tool, tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(tool, "train_run", fake_train_run(calls))
    out, out_json = tmp_path / "arms", tmp_path / "arms.json"
    argv = ["--config", DEMO, "--seeds", "42", "43", "--out", str(out), "--json", str(out_json), "--arm", "dapo",
            "--arm", "lspo", "--arm", "none:scaffold.correction=none", "eval.ks=[1]"]  # fmt: skip
    assert tool.main(argv) == 0
    assert sorted(p.name for p in out.iterdir()) == ["dapo_seed42", "dapo_seed43", "lspo_seed42", "lspo_seed43",
                                                     "none_seed42", "none_seed43"]  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    table = lines[lines.index("| benchmark | arm | pass@1 | accuracy | gold_logprob |") :]
    # Peaks over steps <= 40 (the demo's steps), per seed 42 / 43: pass@1 dapo 0.00 / 0.05, lspo 0.20 / 0.15, none
    # 0.05 / 0.00; gold_logprob dapo -1.90 / -1.80, lspo -1.20 / -1.40, none -1.85 / -1.90.
    # Paired differences from dapo: lspo pass@1 +0.20, +0.10 -> mean +0.15; gold +0.70, +0.40 -> mean +0.55.
    # none pass@1 +0.05, -0.05 -> mean 0.00; gold +0.05, -0.10 -> mean -0.025.
    assert table[2:7] == [
        "| cliff | dapo (n=2) | 2.5 [0.0, 5.0] | 2.5 [0.0, 5.0] | -1.850 [-1.900, -1.800] |",
        "| cliff | lspo (n=2) | 17.5 [15.0, 20.0] | 17.5 [15.0, 20.0] | -1.300 [-1.400, -1.200] |",
        "| cliff | none (n=2) | 2.5 [0.0, 5.0] | 2.5 [0.0, 5.0] | -1.875 [-1.900, -1.850] |",
        "| cliff | lspo - dapo | +15.0 [+10.0, +20.0] | +15.0 [+10.0, +20.0] | +0.550 [+0.400, +0.700] |",
        "| cliff | none - dapo | +0.0 [-5.0, +5.0] | +0.0 [-5.0, +5.0] | -0.025 [-0.100, +0.050] |",
    ]
    lspo = "`scaffold.enabled=true scaffold.supervise=adapter`"
    arms = f"dapo = `scaffold.enabled=false`; lspo = {lspo}; none = `scaffold.correction=none`"
    assert f"Arms (overrides on the config): {arms}." in lines
    # The mechanism figures per arm and seed; the scaffold-off arm has only its cliffs.
    assert "| dapo | 42 | 40 | 10 | scaffold off | | | |" in lines
    assert "| none | 43 | 40 | 10 | 4 | 40.0% | 6 of 80 | 7.5% |" in lines
    assert "lspo: per-step surpass rate over 2 cliff-bearing steps: 0.0% at 0.0, 0.0% at 1.0 (paper: 31% at 0.0, " \
           "21% at 1.0)." in lines  # fmt: skip
    # The JSON keeps its layout, arms keyed by name; the log-likelihoods' peak is their max.
    result = json.loads(out_json.read_text())
    assert result["horizon"] == 40 and list(result["arms"]) == ["dapo", "lspo", "none"]
    cliff = result["arms"]["none"]["42"]["cliff"]
    assert list(cliff) == ["pass@1", "accuracy", "gold_logprob", "gold_logprob_seq"]
    # The mean over the trained steps 10 and 20: (-1.95 - 1.85) / 2 = -1.90, and 40 times it per sequence.
    assert cliff["gold_logprob"] == pytest.approx({"start": -2.0, "peak": -1.85, "last": -1.85, "mean": -1.9})
    assert cliff["gold_logprob_seq"] == pytest.approx({"start": -80.0, "peak": -74.0, "last": -74.0, "mean": -76.0})
    # Run again: every finished run is reused; an arm name given other overrides is refused before training.
    assert tool.main(argv) == 0 and len(calls) == 6
    capsys.readouterr()
    assert tool.main([*argv[:-2], "none:scaffold.correction=sequence", "eval.ks=[1]"]) == 2
    err = capsys.readouterr().err
    assert "none_seed42/config.yaml: a run with scaffold.correction='none', not 'sequence'" in err and len(calls) == 6


def test_the_peak_is_cut_at_the_configs_steps(tool):
    points = [(0, 0.50), (10, 0.60), (20, 0.55), (30, 0.90)]
    evals = [{"kind": "eval", "step": s, "benchmark": "math500", "pass@1": p} for s, p in points]
    results = [{"arm": arm, "seed": 42, "evals": evals, "steps": 20} for arm in ("lspo", "dapo")]
    table, line = tool.peak_table(results, [1], None)
    assert table.horizon == 20 and line == "Horizon: validation steps <= 20, the runs' configured steps."
    assert table.summary("math500", 1, "lspo") == (0.60, 0.60, 0.60)  # not step 30's 0.90
    assert table.baseline == "dapo" and tool.peak_table(results[:1], [1], None)[0].baseline == "lspo"


def test_a_stopped_arm_stops_the_tool_and_resumes(tool, base, tmp_path, monkeypatch):
    calls = []

    def train_run(config, out, resume):  # the first call is SIGTERM'd at step 3: its summary, stopped early
        calls.append((config.seed, config.scaffold.enabled, resume))
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "metrics.jsonl").write_text("")
        stopped = len(calls) == 1
        summary = {"steps": 3 if stopped else config.steps, "stopped_early": stopped}
        (Path(out) / "summary.json").write_text(json.dumps(summary))
        return summary

    monkeypatch.setattr(tool, "train_run", train_run)
    lspo = list(tool.ARMS["lspo"])
    with pytest.raises(SystemExit) as stop:
        tool.run_cell(base, "lspo", lspo, 42, str(tmp_path), "compare_arms")
    assert stop.value.code == 75  # the comparison goes no further than a stopped arm
    # Run again: the stopped arm's summary is not reused as if finished; the arm is trained on.
    assert tool.run_cell(base, "lspo", lspo, 42, str(tmp_path), "compare_arms")["summary"]["stopped_early"] is False
    assert tool.run_cell(base, "lspo", lspo, 42, str(tmp_path), "compare_arms")["summary"]["steps"] == 40  # reused
    assert calls == [(42, True, False), (42, True, False)]


def extending_train_run(calls: list):
    """A stand-in for ``run.train_run`` that trains from the run's last step (resuming) to ``steps``: a train record
    per step, a validation of the cliff class at step 0 and at the end (pass@1 = step / 10), a checkpoint and the
    summary, as a real run leaves them."""

    def train_run(config, out, resume):
        calls.append(("lspo" if config.scaffold.enabled else "dapo", config.steps, resume))
        run = Path(out)
        run.mkdir(parents=True, exist_ok=True)
        (run / "config.yaml").write_text(yaml.safe_dump(to_dict(config)))
        start = json.loads((run / "summary.json").read_text())["steps"] if resume else 0
        records = [{"kind": "eval", "step": 0, "benchmark": "cliff", "pass@1": 0.0}] if start == 0 else []
        records += [{"kind": "train", "step": s} for s in range(start + 1, config.steps + 1)]
        records.append({"kind": "eval", "step": config.steps, "benchmark": "cliff", "pass@1": config.steps / 10})
        with open(run / "metrics.jsonl", "a" if resume else "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in records))
        (run / "checkpoints" / str(config.steps)).mkdir(parents=True, exist_ok=True)
        summary = {"steps": config.steps, "stopped_early": False, "cliff_groups": 0, "surpassed_groups": 0,
                   "surpass_rate": None, "rerolls": 0, "rerolls_passed": 0, "rescue_pass_rate": None}  # fmt: skip
        (run / "summary.json").write_text(json.dumps(summary))
        return summary

    return train_run


def test_a_study_extended_to_a_longer_horizon_resumes_its_runs(tool, tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(tool, "train_run", extending_train_run(calls))
    out = tmp_path / "arms"
    argv = lambda steps: ["--config", DEMO, "--seeds", "42", "--out", str(out), f"steps={steps}", "eval.ks=[1]"]
    assert tool.main(argv(1)) == 0
    capsys.readouterr()
    # Asked for 3 steps: each finished 1-step run is resumed to steps=3, not tabulated as if it had trained them.
    assert tool.main(argv(3)) == 0
    assert calls == [("lspo", 1, False), ("dapo", 1, False), ("lspo", 3, True), ("dapo", 3, True)]
    printed = capsys.readouterr()
    assert "compare_arms: lspo seed 42 finished at step 1; resuming it to steps=3" in printed.err
    steps = [r["step"] for r in map(json.loads, (out / "lspo_seed42" / "metrics.jsonl").read_text().splitlines())]
    assert steps == [0, 1, 1, 2, 3, 3]  # validated at 0, step 1 and validated; resumed: steps 2, 3, validated
    lines = printed.out.splitlines()
    assert "Horizon: validation steps <= 3, the runs' configured steps." in lines
    # The step-3 peak, 0.3 for both arms; and the steps each run trained beside its figures.
    assert "| cliff | lspo (n=1) | 30.0 [30.0, 30.0] |" in lines
    assert "| lspo | 42 | 3 | 0 | 0 | n/a | 0 of 0 | n/a |" in lines
    assert "| dapo | 42 | 3 | 0 | scaffold off | | | |" in lines
    # A shorter horizon reuses the runs as they are, cut back to it (the peak of steps 0 and 1: 0.1), and says that
    # they trained past it: nothing trains.
    assert tool.main(argv(2)) == 0 and len(calls) == 4
    lines = capsys.readouterr().out.splitlines()
    assert "Horizon: validation steps <= 2, the runs' configured steps." in lines
    assert "| cliff | lspo (n=1) | 10.0 [10.0, 10.0] |" in lines
    assert "| dapo | 42 | 3 | 0 | scaffold off | | | |" in lines


def test_what_the_spliced_rows_carried_by_hand(tool):
    # lspo: two steps spliced rows (q50 -1.0 and -0.5 -> mean -0.75; token shares 2% and 4% -> 3.0%; the gradient
    # share recorded on one step only, 10%), one step did not (None: left out). dapo has the scaffold off.
    steps = [
        {"spliced_log_ratio_q10": -3.0, "spliced_log_ratio_q50": -1.0, "spliced_log_ratio_q90": 0.0,
         "spliced_token_share": 0.02, "spliced_grad_share": 0.1},
        {"spliced_log_ratio_q10": -2.0, "spliced_log_ratio_q50": -0.5, "spliced_log_ratio_q90": 0.2,
         "spliced_token_share": 0.04, "spliced_grad_share": None},
        {"spliced_token_share": None},
    ]  # fmt: skip
    results = [{"arm": "lspo", "train": steps}, {"arm": "dapo", "scaffold": False, "train": [{}]}]
    table = tool.spliced_figures(results, ["dapo", "lspo"])
    assert table.splitlines()[2] == "| lspo | 2 | -2.500 | -0.750 | 0.100 | 3.0% | 10.0% |"
    assert len(table.splitlines()) == 3  # no row for the arm without the scaffold
    assert tool.spliced_figures(results[1:], ["dapo"]) == "No arm spliced a row."


def test_a_cell_stopped_before_its_first_checkpoint_starts_again(tmp_path, capsys):
    """``lspo-train`` refuses a new run over an earlier run's records; the tool's own cell that stopped before its
    first checkpoint is removed, said in one line, and started again rather than refused."""
    from tools import resume_or_restart

    cell = tmp_path / "lspo_seed42"
    cell.mkdir()
    (cell / "metrics.jsonl").write_text('{"kind": "eval", "step": 0}\n')
    assert resume_or_restart(str(cell), "compare_arms") is False
    assert not cell.exists() and "stopped before its first checkpoint; starting it again" in capsys.readouterr().err
    (cell / "checkpoints" / "3").mkdir(parents=True)
    assert resume_or_restart(str(cell), "compare_arms") is True and (cell / "checkpoints" / "3").is_dir()
