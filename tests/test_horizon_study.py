"""``tools/horizon_study.py`` on hand-written traces: the peak, last and trained-trace mean per arm, each arm minus
DAPO paired by seed, the frontier lines, and unfinished runs left out by name."""

from __future__ import annotations

import json

import pytest

from tools import horizon_study, tables

# (step, pass@8) of the frontier class per arm and seed; every run starts at 0.1 (the same base model).
TRACES = {
    ("dapo", 1): [(0, 0.1), (25, 0.3), (50, 0.0)],
    ("dapo", 2): [(0, 0.1), (25, 0.1), (50, 0.1)],
    ("lspo", 1): [(0, 0.1), (25, 0.2), (50, 0.2)],
    ("lspo", 2): [(0, 0.1), (25, 0.0), (50, 0.3)],
}


def write_run(root, arm, seed, trace, finished=True, entropy=True):
    run = root / f"{arm}_seed{seed}"
    run.mkdir()
    name = "toy_3term_frontier"
    records = [{"kind": "eval", "step": s, "benchmark": name, "pass@8": v}
               | ({"answer_entropy": 2.0 - s / 50} if entropy else {}) for s, v in trace]  # fmt: skip
    records.insert(1, {"kind": "train", "step": 1, "loss": 0.5})  # not a validation: ignored
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if finished:
        (run / "summary.json").write_text("{}")


def test_peak_last_mean_and_the_paired_differences_by_hand(tmp_path, capsys):
    for (arm, seed), trace in TRACES.items():
        write_run(tmp_path, arm, seed, trace)
    write_run(tmp_path, "lspo", 3, [(0, 0.1), (25, 0.9)], finished=False)
    code = horizon_study.main(["--out", str(tmp_path), "--arms", "dapo", "lspo", "--seeds", "1", "2", "3",
                               "--metrics", "pass@8", "--json", str(tmp_path / "s.json"),
                               "--plot", str(tmp_path / "band")])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0
    assert "4 finished runs; left out (unfinished or absent): dapo_seed3, lspo_seed3" in printed
    # dapo: peaks 30, 10 -> 20.0 [10.0, 30.0]; last 0, 10 -> 5.0; trained means (30 + 0) / 2 = 15 and 10 -> 12.5.
    assert "| dapo | 1 2 | 20.0 [10.0, 30.0] | 5.0 [0.0, 10.0] | 12.5 [10.0, 15.0] |  |  |  |" in printed
    # lspo: peaks 20, 30; last 20, 30; means 20, 15. Paired: peak 20 - 30 = -10 and 30 - 10 = +20 -> +5.0;
    # last 20 - 0 and 30 - 10 -> +20.0 both; mean 20 - 15 and 15 - 10 -> +5.0 both.
    want = ("| lspo | 1 2 | 25.0 [20.0, 30.0] | 25.0 [20.0, 30.0] | 17.5 [15.0, 20.0] | +5.0 [-10.0, +20.0] "
            "| +20.0 [+20.0, +20.0] | +5.0 [+5.0, +5.0] |")  # fmt: skip
    assert want in printed
    assert "- dapo seed 1: pass@8 10.0 at 0, peak 30.0 at step 25, 0.0 at 50 (mean 15.0); answer entropy 2.00 -> " \
           "1.00 nats (mean 1.25)" in printed  # fmt: skip
    for metric in ("pass8", "answer_entropy"):  # a rate in percent, an entropy in nats: one panel each
        assert (tmp_path / f"band_{metric}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((tmp_path / "s.json").read_text())
    assert saved["classes"]["lspo"]["2"]["toy_3term_frontier"]["pass@8"]["peak_step"] == 50


def test_nothing_finished_is_one_line(tmp_path, capsys):
    write_run(tmp_path, "dapo", 1, TRACES["dapo", 1], finished=False)
    assert horizon_study.main(["--out", str(tmp_path), "--seeds", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no finished run under" in err


def test_a_run_that_never_recorded_a_key_leaves_the_arms_band_to_the_others(tmp_path):
    write_run(tmp_path, "dapo", 1, TRACES["dapo", 1], entropy=False)  # a run from before the key existed
    write_run(tmp_path, "dapo", 2, TRACES["dapo", 2])
    runs, _ = horizon_study.load(str(tmp_path), ["dapo"], [1, 2])
    steps, mean, low, high, n = tables.curves(runs, "toy_3term_frontier", "answer_entropy")["dapo"]
    assert n == 1 and steps == [0, 25, 50] and list(mean) == [2.0, 1.5, 1.0]
    assert tables.curves(runs, "toy_3term_frontier", "pass@8")["dapo"][4] == 2  # both seeds where both recorded


def test_the_mechanism_table_reads_each_runs_summary_and_sampler_records(tmp_path):
    write_run(tmp_path, "lspo", 1, TRACES["lspo", 1])
    write_run(tmp_path, "ds", 1, TRACES["dapo", 1])
    summaries = {  # what the loop writes, cut to the keys the table reads
        "lspo_seed1": {"steps": 2, "cliff_groups": 10, "surpass_rate": 0.5, "rescue_pass_rate": 0.25,
                       "rollouts_spent": 256, "seconds": 120.0},
        "ds_seed1": {"steps": 2, "cliff_groups": 4, "surpass_rate": None, "rescue_pass_rate": None,
                     "rollouts_spent": 600, "seconds": 60.0},
    }  # fmt: skip
    for name, summary in summaries.items():
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    sampler = [{"kind": "train", "step": s, "sampler/kept": kept, "sampler/filled": 16 - kept} for s, kept in
               ((1, 16), (2, 9))]  # fmt: skip
    with open(tmp_path / "ds_seed1" / "metrics.jsonl", "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in sampler))
    spliced = [{"kind": "train", "step": 1, "spliced_ratio_mean": 0.2, "spliced_grad_share": 0.5},
               {"kind": "train", "step": 2, "spliced_ratio_mean": None, "spliced_grad_share": None},
               {"kind": "train", "step": 3, "spliced_ratio_mean": 0.05, "spliced_grad_share": 0.1}]  # fmt: skip
    with open(tmp_path / "lspo_seed1" / "metrics.jsonl", "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in spliced))
    runs, _ = horizon_study.load(str(tmp_path), ["lspo", "ds"], [1])
    lines = horizon_study.mechanism_table(runs).splitlines()
    # lspo: 50% surpassed, 25% verified, 256 / 2 = 128 rollouts a step; over the 2 steps with spliced rows the ratio
    # (0.2 + 0.05) / 2 = 0.125 and the gradient share (50 + 10) / 2 = 30%; no sampler records, 2 minutes.
    assert lines[2] == "| lspo | 1 | 10 | 50.0 | 25.0 | 128 | 0.125 | 30.0 | - | - | 2 |"
    # ds: no scaffold; 600 / 2 = 300 rollouts a step; kept (16 + 9) / 2 = 12.5; one step short of 16 (at the bound).
    assert lines[3] == "| ds | 1 | 4 | - | - | 300 | - | - | 12.5 | 1 | 1 |"


# The gain-against-cost traces at the horizon (step 200; the validation at 225 is past it): per run the frontier's
# (pass@8, coverage pass@256, accuracy), the beyond-reach accuracy and the 3-digit accuracy. lspo seed 2's coverage
# pass did not run at 200.
AT_200 = {
    ("dapo", 1): (0.30, 0.50, 0.10, 0.00, 0.90),
    ("dapo", 2): (0.20, 0.60, 0.05, 0.00, 0.80),
    ("lspo", 1): (0.50, 0.55, 0.20, 0.02, 0.85),
    ("lspo", 2): (0.40, None, 0.15, 0.04, 0.80),
}
# The beyond-reach class's coverage pass@256 at 200, where its pass ran (not in lspo seed 2).
BEYOND_COVERAGE_200 = {("dapo", 1): 0.0, ("dapo", 2): 0.0, ("lspo", 1): 0.1}
# The frontier's coverage pass@1 (the share of correct samples) at 200, where its pass ran; 0.01 at step 0.
PASS1_AT_200 = {"dapo": 0.02, "lspo": 0.03}
# (step, adapter reliance, spliced gradient share) of the lspo runs' training records; step 225 is past the horizon.
TRAIN = {
    1: [(50, 0.2, 0.30), (100, 0.4, None), (150, None, 0.10), (225, 9.9, None)],  # 150: no spliced tokens
    2: [(50, 0.1, None)],
}


def write_horizon_run(root, arm, seed):
    run = root / f"{arm}_seed{seed}"
    run.mkdir()
    p8, cov, acc, beyond, learned = AT_200[arm, seed]
    frontier = {"kind": "eval", "benchmark": "toy_heldout_3term_frontier"}
    covered = {"coverage/pass@256": cov, "coverage/pass@1_unbiased": PASS1_AT_200[arm]} if cov else {}
    records = [frontier | {"step": 0, "pass@8": 0.0, "accuracy": 0.0, "coverage/pass@256": 0.1,
                           "coverage/pass@1_unbiased": 0.01},
               {"kind": "eval", "step": 0, "benchmark": "toy_heldout_3digit", "accuracy": 0.3},
               frontier | {"step": 200, "pass@8": p8, "accuracy": acc} | covered,
               {"kind": "eval", "step": 200, "benchmark": "toy_heldout_4digit_cliff_beyond", "accuracy": beyond}
               | ({"coverage/pass@256": BEYOND_COVERAGE_200[arm, seed]} if (arm, seed) in BEYOND_COVERAGE_200 else {}),
               {"kind": "eval", "step": 200, "benchmark": "toy_heldout_3digit", "accuracy": learned},
               frontier | {"step": 225, "pass@8": 1.0, "accuracy": 1.0, "coverage/pass@256": 1.0,
                           "coverage/pass@1_unbiased": 1.0}]  # fmt: skip
    records += [{"kind": "train", "step": s, "scaffold/adapter_reliance": r} | ({"spliced_grad_share": g} if g else {})
                for s, r, g in (TRAIN[seed] if arm == "lspo" else [])]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "summary.json").write_text("{}")


def test_gain_against_cost_and_reliance_at_the_horizon_by_hand(tmp_path, capsys):
    for arm, seed in AT_200:
        write_horizon_run(tmp_path, arm, seed)
    argv = ["--out", str(tmp_path), "--arms", "dapo", "lspo", "--seeds", "1", "2", "--horizon", "200", "--metrics",
            "pass@8", "--plot", str(tmp_path / "h"), "--json", str(tmp_path / "h.json")]  # fmt: skip
    assert horizon_study.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    # dapo: pass@8 30, 20; pass@256 50, 60; frontier accuracy 10, 5; beyond reach 0, 0 and its pass@256 0, 0;
    # 3-digit 90, 80. No difference from itself.
    assert ("| dapo | 1 2 | 25.0 [20.0, 30.0] |  | 55.0 [50.0, 60.0] |  | 7.5 [5.0, 10.0] |  | 0.0 [0.0, 0.0] |  "
            "| 0.0 [0.0, 0.0] |  | 85.0 [80.0, 90.0] |  |") in lines  # fmt: skip
    # lspo: pass@8 50 - 30 and 40 - 20; pass@256 55 - 50 (seed 2 has none at 200, so over seed 1 alone); accuracy
    # 20 - 10 and 15 - 5; beyond reach 2 - 0 and 4 - 0, its pass@256 10 - 0 (seed 1 alone); 3-digit 85 - 90 and
    # 80 - 80 -> -2.5 [-5.0, +0.0].
    want = (
        "| lspo | 1 2 | 45.0 [40.0, 50.0] | +20.0 [+20.0, +20.0] | 55.0 | +5.0 (seeds 1) | 17.5 [15.0, 20.0] "
        "| +10.0 [+10.0, +10.0] | 3.0 [2.0, 4.0] | +3.0 [+2.0, +4.0] | 10.0 | +10.0 (seeds 1) | 82.5 [80.0, 85.0] "
        "| -2.5 [-5.0, +0.0] |"
    )
    assert want in lines
    assert not any(line.startswith("Values short of the horizon") for line in lines)  # every value is at 200
    # Coverage pass@1 / pass@256: step 0 0.01 / 0.1 in every run; at 200 dapo (0.02, 0.02) / (0.50, 0.60), lspo seed
    # 1 alone 0.03 / 0.55 (seed 2's pass did not run). Step 225 is past the horizon.
    assert "| dapo | frontier | 2 | 1.00 / 10.0 | 2.00 / 55.0 |" in lines
    assert "| lspo | frontier | 2 | 1.00 / 10.0 | 3.00 / 55.0 |" in lines
    # Reliance: seed 1 (0.2 + 0.4) / 2 (9.9 at step 225 is past the horizon), shares 30% at 50 and 10% at 150;
    # seed 2 0.1, no share recorded. dapo: none.
    assert "| lspo | 1 | 0.300 | 30.0 | 10.0 | +20.0 | +5.0 |" in lines
    assert "| lspo | 2 | 0.100 | - | - | +20.0 | - |" in lines
    assert not any(line.startswith("| dapo | 1 | ") for line in lines)
    assert (tmp_path / "h_gain_cost.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((tmp_path / "h.json").read_text())
    assert saved["at_horizon"]["lspo"]["2"]["frontier pass@256"] is None  # not run at 200: no value, not NaN
    assert saved["at_horizon"]["lspo"]["1"]["steps"]["3-digit accuracy"] == 200
    assert saved["reliance"]["lspo"]["1"]["reliance"] == pytest.approx(0.3) and saved["reliance"]["dapo"]["1"] is None


def test_a_value_short_of_the_horizon_is_named():
    steps = horizon_study.STEPS
    figures = {"a": {1: {"x": 5.0, "y": float("nan"), steps: {"x": 175, "y": 175}},
                     2: {"x": 6.0, "y": 1.0, steps: {"x": 200, "y": 200}}}}  # fmt: skip
    # Seed 1's x is from step 175; its y (not recorded there) is left out, as its cell is.
    assert horizon_study.off_horizon(figures, 200) == ["a seed 1: x at step 175"]
    assert horizon_study.off_horizon(figures, None) == ["a seed 1: x at step 175"]  # short of the latest step


def test_the_association_pooled_within_seed_and_within_arm_by_hand():
    # Reliance x and pass@8 gain y of four runs (dapo 0 on both seeds, so y is the arm's own value):
    # (a, 1) 1, 2; (a, 2) 2, 4; (b, 1) 3, 1; (b, 2) 4, 3.
    # Pooled: x - 2.5 = (-1.5, -0.5, 0.5, 1.5), y - 2.5 = (-0.5, 1.5, -1.5, 0.5); the sum of products
    # 0.75 - 0.75 - 0.75 + 0.75 = 0, so r = 0.
    # Within seed: seed 1 x (1, 3) -> (-1, 1), y (2, 1) -> (0.5, -0.5); seed 2 x (2, 4) -> (-1, 1), y (4, 3) ->
    # (0.5, -0.5): every pair opposite, r = -1. Within arm: a x (1, 2) -> (-0.5, 0.5), y (2, 4) -> (-1, 1); b x
    # (3, 4) -> (-0.5, 0.5), y (1, 3) -> (-1, 1): r = +1.
    xy = {("a", 1): (1.0, 2.0), ("a", 2): (2.0, 4.0), ("b", 1): (3.0, 1.0), ("b", 2): (4.0, 3.0)}
    nan = float("nan")
    relied = {"dapo": {1: None, 2: None}, "a": {}, "b": {}}
    figures = {"dapo": {1: {"g8": 0.0, "g256": 0.0}, 2: {"g8": 0.0, "g256": 0.0}}, "a": {}, "b": {}}
    for (arm, seed), (x, y) in xy.items():
        # share@50 recorded by one run only; the pass@256 gain is the same in every run (no spread).
        relied[arm][seed] = {"reliance": x, "share@50": 0.3 if (arm, seed) == ("a", 1) else nan}
        figures[arm][seed] = {"g8": y, "g256": 7.0}
    lines = horizon_study.association_table(relied, figures, "dapo", [50], ["g8", "g256"]).splitlines()
    assert "| adapter reliance | g8 - dapo | 4 | +0.00 | -1.00 | +1.00 |" in lines
    assert "| adapter reliance | g256 - dapo | 4 | - | - | - |" in lines
    assert "| grad share @50 | g8 - dapo | 1 | - | - | - |" in lines
    assert horizon_study.association_table({"dapo": {1: None}}, figures, "dapo", [50], ["g8"]).startswith("No run")


def test_runs_validated_at_n_4_say_why_pass_at_8_is_left_out(tmp_path, capsys):
    for (arm, seed), trace in TRACES.items():
        run = tmp_path / f"{arm}_seed{seed}"
        run.mkdir()
        records = [{"kind": "eval", "step": s, "benchmark": "toy_3term_frontier", "pass@1": v / 2, "pass@4": v}
                   for s, v in trace]  # fmt: skip
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (run / "summary.json").write_text("{}")
    argv = ["--out", str(tmp_path), "--seeds", "1", "2", "--metrics", "pass@8", "--plot", str(tmp_path / "band")]
    assert horizon_study.main(argv) == 0
    captured = capsys.readouterr()
    assert "horizon_study: no run's validation recorded pass@8, left out of the tables and pictures; they recorded " \
           "pass@1, pass@4 (pass@k up to the eval.n they validated with: --metrics pass@4)" in captured.err  # fmt: skip
    assert "toy_3term_frontier, pass@8" not in captured.out and not (tmp_path / "band_pass8.png").exists()
    assert "The frontier class per run (pass@4 in %" in captured.out  # the largest k they hold, not an empty pass@8


def test_an_earlier_studys_arm_joins_the_table_where_its_baseline_is_the_same(tmp_path, capsys):
    for arm, seed in AT_200:
        write_horizon_run(tmp_path, arm, seed)
    common = ["--out", str(tmp_path), "--seeds", "1", "2", "--horizon", "200", "--metrics", "pass@8"]
    assert horizon_study.main([*common, "--arms", "dapo", "lspo", "--json", str(tmp_path / "before.json")]) == 0
    saved = json.loads((tmp_path / "before.json").read_text())
    for f in saved["at_horizon"]["lspo"].values():  # an earlier study had no beyond-reach coverage column
        del f["beyond-reach pass@256"]
    (tmp_path / "before.json").write_text(json.dumps(saved))
    capsys.readouterr()
    earlier = f"{tmp_path / 'before.json'}:lspo=lspo_before"
    assert horizon_study.main([*common, "--arms", "dapo", "--earlier", earlier]) == 0
    lines = capsys.readouterr().out.splitlines()
    # The earlier lspo's figures, as in the by-hand test above; its beyond-reach coverage column not recorded: "-".
    want = (
        "| lspo_before | 1 2 | 45.0 [40.0, 50.0] | +20.0 [+20.0, +20.0] | 55.0 | +5.0 (seeds 1) | 17.5 [15.0, 20.0] "
        "| +10.0 [+10.0, +10.0] | 3.0 [2.0, 4.0] | +3.0 [+2.0, +4.0] | - | - | 82.5 [80.0, 85.0] | -2.5 [-5.0, +0.0] |"
    )
    assert want in lines
    saved["at_horizon"]["dapo"]["2"]["frontier accuracy"] += 1.0  # not the runs this study's dapo is
    (tmp_path / "before.json").write_text(json.dumps(saved))
    assert horizon_study.main([*common, "--arms", "dapo", "--earlier", earlier]) == 2  # one line, exit 2
    err = capsys.readouterr().err
    assert "its dapo differs from this study's on seeds 2, so its lspo cannot be paired with it" in err
    (tmp_path / "before.json").write_text("{not json")
    assert horizon_study.main([*common, "--arms", "dapo", "--earlier", earlier]) == 2
    assert "before.json is not a study's --json" in capsys.readouterr().err
