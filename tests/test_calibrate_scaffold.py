"""``tools/calibrate_scaffold.py``: the scaffold's figures of a run and of an arm's runs pooled, checked by hand on
constructed records, the paper's band, and the command end to end with training replaced by a stand-in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lspo_jax.job.config_io import to_dict
from tools import calibrate_scaffold as tool
from tools import compare_arms

DEMO = str(Path(__file__).resolve().parents[1] / "configs" / "demo.yaml")


def _step(attempted: int, surpassed: int, rerolls: int, passed: int) -> dict:
    rate = surpassed / attempted if attempted else None
    return {"kind": "train", "scaffold_attempted": attempted, "surpassed_groups": surpassed, "rerolls": rerolls,
            "rerolls_passed": passed, "surpass_rate": rate}  # fmt: skip


# Seed A: three steps, one without cliffs. Seed B: two steps.
SEED_A = [_step(4, 0, 32, 0), _step(0, 0, 0, 0), _step(2, 2, 16, 5)]
SEED_B = [_step(3, 1, 24, 1), _step(1, 0, 8, 0)]


def test_one_runs_figures_by_hand():
    f = tool.run_figures(SEED_A)
    # 2 surpassed of 6 attempted; 5 passing re-rolls of 48; of the 2 steps that attempted a cliff, one surpassed none
    # and one all of them.
    assert (f["attempted"], f["surpassed"], f["rerolls"], f["passed"], f["steps_attempted"]) == (6, 2, 48, 5, 2)
    assert f["surpass"] == pytest.approx(2 / 6) and f["rollout_pass"] == pytest.approx(5 / 48)
    assert (f["steps_at_0"], f["steps_at_1"]) == (0.5, 0.5)
    none = tool.run_figures([_step(0, 0, 0, 0)])
    assert none["surpass"] is none["rollout_pass"] is none["steps_at_0"] is None


def test_pooled_figures_sum_the_counts_and_weigh_the_step_shares_by_steps():
    f = tool.pooled([tool.run_figures(SEED_A), tool.run_figures(SEED_B)])
    # Counts summed: 3 of 10 surpassed, 6 of 80 re-rolls passed (not the mean of 2/6 and 1/4).
    assert f["surpass"] == pytest.approx(3 / 10) and f["rollout_pass"] == pytest.approx(6 / 80)
    # 4 cliff-bearing steps: at 0 are A's first and B's second (2 of 4); at 1 is A's third (1 of 4).
    assert f["steps_at_0"] == pytest.approx(0.5) and f["steps_at_1"] == pytest.approx(0.25)
    assert f["cliffs_per_step"] == pytest.approx(10 / 4)
    assert f["surpass_range"] == pytest.approx((0.25, 2 / 6)) and f["steps_at_1_range"] == (0.0, 0.5)


def test_the_papers_band_marks_only_the_figures_inside_it():
    assert tool.in_band({"rollout_pass": 0.06, "surpass": 0.53}) == {"rollout_pass": True, "surpass": False}
    assert tool.in_band({"rollout_pass": 0.039, "surpass": 0.35}) == {"rollout_pass": False, "surpass": True}
    assert tool.in_band({"rollout_pass": None, "surpass": None}) == {"rollout_pass": False, "surpass": False}


def test_the_command_trains_short_runs_without_validation_and_tabulates_them(tmp_path, monkeypatch, capsys):
    calls = []

    def train_run(config, out, resume):
        calls.append((config.steps, config.eval.enabled, config.scaffold.sft_steps, config.seed))
        records = SEED_A if config.seed == 42 else SEED_B
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "config.yaml").write_text(yaml.safe_dump(to_dict(config)))
        (Path(out) / "metrics.jsonl").write_text("".join(json.dumps({**r, "step": i + 1}) + "\n"
                                                         for i, r in enumerate(records)))  # fmt: skip
        summary = {"steps": config.steps, "stopped_early": False}
        (Path(out) / "summary.json").write_text(json.dumps(summary))
        return summary

    monkeypatch.setattr(compare_arms, "train_run", train_run)
    argv = ["--config", DEMO, "--seeds", "42", "43", "--steps", "3", "--out", str(tmp_path), "--arm",
            "s2:scaffold.sft_steps=2", "--json", str(tmp_path / "c.json")]  # fmt: skip
    assert tool.main(argv) == 0
    assert calls == [(3, False, 2, 42), (3, False, 2, 43)]
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| s2 "))
    # 2.5 cliffs a step; 6 of 80 re-rolls passed, 7.5% (seeds 1/32 = 3.1% and 5/48 = 10.4%), in the paper's 4-8%;
    # 3 of 10 groups surpassed, 30.0% (below its 35-50%).
    assert row.startswith("| s2 | `scaffold.sft_steps=2` | 2.5 | 7.5 [3.1, 10.4] in band | 30.0 [25.0, 33.3] |")
    saved = json.loads((tmp_path / "c.json").read_text())
    assert saved["arms"]["s2"]["per_seed"]["43"]["surpass"] == pytest.approx(0.25)
    assert tool.main(argv) == 0 and len(calls) == 2  # reused
