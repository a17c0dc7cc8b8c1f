"""Peak-over-trace tables of two arms x two seeds from recorded ``metrics.jsonl`` files, checked by hand, through
``tools/compare_runs.py``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from tools import tables

ROOT = Path(__file__).resolve().parents[1]

# (arm, seed) -> benchmark -> [(step, pass@1, pass@4)]. Step 30 lies past the horizon of 20 used below.
TRACES = {
    ("lspo", 42): {"math500": [(0, 0.50, 0.70), (10, 0.60, 0.72), (20, 0.55, 0.80), (30, 0.90, 0.95)],
                   "aime24": [(10, 0.10, 0.30), (20, 0.20, 0.25)]},
    ("lspo", 43): {"math500": [(0, 0.40, 0.60), (10, 0.52, 0.66), (20, 0.58, 0.64), (30, 0.99, 0.99)]},
    ("dapo", 42): {"math500": [(0, 0.50, 0.70), (10, 0.51, 0.71), (20, 0.53, 0.69)],
                   "aime24": [(10, 0.10, 0.20)]},
    ("dapo", 43): {"math500": [(0, 0.40, 0.60), (10, 0.45, 0.62), (20, 0.44, 0.65)],
                   "aime24": [(10, 0.00, 0.10)]},
}  # fmt: skip


def write_run(directory: Path, trace: dict, config: dict | None = None) -> str:
    directory.mkdir()
    records = []
    for step in (0, 10, 20, 30):
        records.append({"kind": "train", "step": step + 1, "accuracy_mean": 0.3, "pass@1": 1.0})  # never read
        for benchmark, points in trace.items():
            for s, p1, p4 in (p for p in points if p[0] == step):
                # The unbiased values are written as half the first-k ones, to tell the estimators apart.
                unbiased = {"pass@1_unbiased": p1 / 2, "pass@4_unbiased": p4 / 2}
                records.append(
                    {"kind": "eval", "step": s, "benchmark": benchmark, "pass@1": p1, "pass@4": p4, **unbiased}
                )
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if config is not None:
        (directory / "config.yaml").write_text(yaml.safe_dump(config))
    return str(directory)


@pytest.fixture
def run_args(tmp_path) -> list[str]:
    """The LSPO runs named on the command line (ARM:SEED=DIR); the DAPO runs told apart by their config.yaml."""
    args = []
    for (arm, seed), trace in TRACES.items():
        if arm == "lspo":
            args.append(f"lspo:{seed}={write_run(tmp_path / f'l{seed}', trace)}")
        else:
            args.append(write_run(tmp_path / f"d{seed}", trace, {"scaffold": {"enabled": False}, "seed": seed}))
    return args


def compare_runs():
    from tools import compare_runs

    return compare_runs


def test_compare_runs_table_by_hand(run_args, tmp_path, capsys):
    out, png = tmp_path / "table.md", tmp_path / "table.png"
    assert compare_runs().main([*run_args, "--horizon", "20", "--per-seed", "--out", str(out), "--plot", str(png)]) == 0
    text = out.read_text()
    assert text in capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0].startswith("Peak held-out pass@k (%, first-k slice) over validation steps <= 20")
    table = lines[lines.index("| benchmark | arm | pass@1 | pass@4 |") :]
    # Peaks up to step 20. math500 pass@1: lspo 0.60, 0.58; dapo 0.53, 0.45 -> means 0.59, 0.49, difference +0.10,
    # paired per seed 0.60 - 0.53 = +0.07 and 0.58 - 0.45 = +0.13. pass@4: lspo 0.80, 0.66; dapo 0.71, 0.65
    # -> means 0.73, 0.68, difference +0.05, paired +0.09 and +0.01.
    # aime24: lspo seed 43 never recorded it; pass@1 lspo 0.20; dapo 0.10, 0.00. The difference is paired: seed 42
    # alone, 0.20 - 0.10 = +0.10 (pass@4: 0.30 - 0.20), not the difference of the means (0.20 - 0.05).
    assert table[2:8] == [
        "| math500 | dapo (n=2) | 49.0 [45.0, 53.0] | 68.0 [65.0, 71.0] |",
        "| math500 | lspo (n=2) | 59.0 [58.0, 60.0] | 73.0 [66.0, 80.0] |",
        "| math500 | lspo - dapo | +10.0 [+7.0, +13.0] | +5.0 [+1.0, +9.0] |",
        "| aime24 | dapo (n=2) | 5.0 [0.0, 10.0] | 15.0 [10.0, 20.0] |",
        "| aime24 | lspo (n=2) | 20.0 [20.0, 20.0] (1 of 2 runs) | 30.0 [30.0, 30.0] (1 of 2 runs) |",
        "| aime24 | lspo - dapo | +10.0 [+10.0, +10.0] | +10.0 [+10.0, +10.0] |",
    ]
    per_seed = lines[lines.index("| benchmark | arm | seed | pass@1 | pass@4 |") :]
    assert per_seed[2:4] == ["| math500 | dapo | 42 | 53.0 | 71.0 |", "| math500 | dapo | 43 | 45.0 | 65.0 |"]
    assert "| aime24 | lspo | 43 | n/a | n/a |" in per_seed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_estimator_horizon_and_baseline(run_args):
    runs = [compare_runs().parse_run(a) for a in run_args]
    assert [(r.arm, r.seed) for r in runs] == list(TRACES)
    whole = tables.peak_table(runs, estimator="unbiased", benchmarks=["math500"], ks=[1])
    # No horizon: step 30 counts; the unbiased values were written as half the first-k ones.
    assert whole.summary("math500", 1, "lspo") == pytest.approx(((0.90 + 0.99) / 4, 0.45, 0.495))
    assert whole.arms == ["dapo", "lspo"] and whole.seeds == {"lspo": [42, 43], "dapo": [42, 43]}
    flipped = tables.peak_table(runs, baseline="lspo", horizon=20, ks=[1])
    mean, (low, high) = flipped.difference("math500", 1, "dapo")
    assert (mean, low, high) == pytest.approx((-0.10, -0.13, -0.07))
    with pytest.raises(ValueError, match="baseline arm 'grpo'"):
        tables.peak_table(runs, baseline="grpo")


def test_records_without_a_benchmark_are_one_pooled_set():
    evals = [{"kind": "eval", "step": 10, "pass@1": 0.3}, {"kind": "eval", "step": 20, "pass@1": 0.2}]
    assert tables.peak(evals, tables.UNNAMED_BENCHMARK, "pass@1") == 0.3
    assert tables.peak(evals, tables.UNNAMED_BENCHMARK, "pass@1", horizon=15) == 0.3
    assert math.isnan(tables.peak(evals, tables.UNNAMED_BENCHMARK, "pass@1", horizon=5))
    assert math.isnan(tables.peak(evals, "math500", "pass@1"))


def test_the_horizon_defaults_to_the_runs_configured_steps(tmp_path, capsys):
    # Both runs were configured for 20 steps; lspo's record at step 30 (pass@1 0.90, from a longer resumed run)
    # lies past that matched horizon, so its peak is 0.60 (step 10) unless --horizon says otherwise.
    def run(name, arm, steps):
        config = {"scaffold": {"enabled": arm == "lspo"}, "seed": 42, "steps": steps}
        return write_run(tmp_path / name, TRACES[arm, 42], config)

    lspo, dapo = run("l", "lspo", 20), run("d", "dapo", 20)
    out = tmp_path / "table.md"
    assert compare_runs().main([lspo, dapo, "--benchmarks", "math500", "--out", str(out)]) == 0
    text = out.read_text()
    assert text in capsys.readouterr().out
    assert "Horizon: validation steps <= 20, the runs' configured steps." in text.splitlines()
    assert "| math500 | lspo (n=1) | 60.0 [60.0, 60.0] | 80.0 [80.0, 80.0] |" in text.splitlines()
    # Runs that disagree: the smallest, said so; --horizon still overrides.
    longer = run("d30", "dapo", 30)
    assert compare_runs().main([lspo, longer, "--benchmarks", "math500"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "Horizon: validation steps <= 20, the smallest of the runs' steps (20, 30)." in lines
    assert compare_runs().main([lspo, dapo, "--benchmarks", "math500", "--horizon", "30"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "Horizon: validation steps <= 30 (--horizon)." in lines
    assert "| math500 | lspo (n=1) | 90.0 [90.0, 90.0] | 95.0 [95.0, 95.0] |" in lines


def test_start_peak_last_and_curves_by_hand(run_args, tmp_path):
    runs = [compare_runs().parse_run(a) for a in run_args]
    out = tables.start_peak_last(runs, horizon=20)
    assert out["horizon"] == 20 and set(out["arms"]) == {"lspo", "dapo"}
    # lspo seed 42, math500 up to step 20: pass@1 0.50, 0.60, 0.55 -> start 0.50, peak 0.60, last 0.55 (step 30's
    # 0.90 is past the horizon); the unbiased values are half the first-k ones.
    # The mean is over the trained steps 10 and 20: (0.60 + 0.55) / 2 = 0.575; unbiased pass@4 (0.36 + 0.40) / 2.
    math500 = out["arms"]["lspo"]["42"]["math500"]
    assert math500["pass@1"] == pytest.approx({"start": 0.50, "peak": 0.60, "last": 0.55, "mean": 0.575})
    assert math500["pass@4_unbiased"] == pytest.approx({"start": 0.35, "peak": 0.40, "last": 0.40, "mean": 0.38})
    assert list(math500) == ["pass@1", "pass@4", "pass@1_unbiased", "pass@4_unbiased"]
    # aime24 of lspo 42 starts at step 10 (its first record): 0.10, then 0.20.
    assert out["arms"]["lspo"]["42"]["aime24"]["pass@1"] == pytest.approx(
        {"start": 0.10, "peak": 0.20, "last": 0.20, "mean": 0.15}
    )
    assert "aime24" not in out["arms"]["lspo"]["43"]
    # Curves: dapo pass@1 at steps 0, 10, 20 over seeds 42 and 43 = (0.50, 0.40), (0.51, 0.45), (0.53, 0.44).
    steps, mean, low, high, n = tables.curves(runs, "math500", "pass@1", horizon=20)["dapo"]
    assert steps == [0, 10, 20] and n == 2
    assert mean == pytest.approx([0.45, 0.48, 0.485]) and list(low) == [0.40, 0.45, 0.44]
    assert list(high) == [0.50, 0.51, 0.53]
    # aime24: only steps every seed reached (lspo 43 has none, so lspo has no aime24 curve).
    assert "lspo" not in tables.curves(runs, "aime24", "pass@1")
    png = tables.plot_curves(runs, str(tmp_path / "curves.png"), horizon=20)
    assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _ablate(monkeypatch):
    from tools import ablate

    return ablate


def test_ablate_grid_cells_and_refusals(monkeypatch, capsys):
    ablate = _ablate(monkeypatch)
    from lspo_jax.job.config import load_config
    from lspo_jax.train_config import ConfigError

    base = load_config(str(ROOT / "configs" / "demo.yaml"))
    grid = ablate.parse_grid(["scaffold.splice=partial,group", "scaffold.correction=token,sequence,none"])
    cells = ablate.cells(base, grid)
    assert len(cells) == 6 and cells[0] == ("splice=partial,correction=token",
                                            ["scaffold.splice=partial", "scaffold.correction=token"])  # fmt: skip
    assert cells[-1][0] == "splice=group,correction=none"
    for bad in ("scaffold.splice", "scaffold.splice=", "scaffold.splice=partial,,group"):
        with pytest.raises(ConfigError, match="KEY=VALUE1,VALUE2"):
            ablate.parse_grid([bad])
    # A value no config takes fails before anything trains, naming its key, in one line.
    assert ablate.main(["--grid", "scaffold.splice=partial,swap", "--out", "/nonexistent/ablate"]) == 2
    assert capsys.readouterr().err.strip().startswith("ablate: scaffold.splice: must be one of")


def test_ablate_figures_of_a_run(monkeypatch):
    ablate = _ablate(monkeypatch)
    # Spliced ratio mean: the mean over the steps that spliced, (0.8 + 0.6) / 2 = 0.7; a step without is skipped.
    run = {
        "summary": {"surpass_rate": 0.25, "rescue_pass_rate": None},
        "train": [{"spliced_ratio_mean": 0.8}, {"spliced_ratio_mean": None}, {"spliced_ratio_mean": 0.6}],
    }
    figures = ablate.figures(run)
    assert figures["surpass_rate"] == 0.25 and figures["rescue_pass_rate"] is None
    assert math.isclose(figures["spliced_ratio_mean"], 0.7)
    table = ablate.figures_table([{**run, "arm": "a"}, {**run, "arm": "a"}], ["a"])
    assert table.splitlines()[-1] == "| a | 25.0 [25.0, 25.0] | n/a | 0.700 [0.700, 0.700] |"


def test_compare_runs_refuses_what_is_not_a_run_in_one_line(run_args, tmp_path, capsys):
    def refused(argv: list[str]) -> str:
        assert compare_runs().main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1
        return err

    # A directory without a run's records, a run whose arm nothing says, and a baseline arm that has no runs.
    notes = tmp_path / "notes"
    notes.mkdir()
    assert refused([str(notes)]) == (
        f"compare_runs: {notes}: not a training run (no metrics.jsonl); give lspo-train's --out directory\n"
    )
    bare = write_run(tmp_path / "bare", TRACES["lspo", 42])
    assert refused([bare]) == f"compare_runs: {bare}: no config.yaml to tell the arm from; write it as ARM=DIR\n"
    assert refused([*run_args, "--baseline", "grpo"]).startswith("compare_runs: baseline arm 'grpo' has no runs")


def test_ablate_refuses_a_repeated_seed_before_anything_trains(monkeypatch, capsys):
    ablate = _ablate(monkeypatch)
    monkeypatch.setattr(ablate, "run_cell", lambda *a, **k: pytest.fail("trained"))
    assert ablate.main(["--grid", "scaffold.splice=partial,group", "--seeds", "1", "1", "--out", "/nonexistent/x"]) == 2
    assert capsys.readouterr().err == "ablate: --seeds: 1 given twice; give each seed once\n"
