"""The run's PNG curves from a hand-written ``metrics.jsonl``: a resumed run's repeated step, a near-constant
entropy, panels only for the keys the records hold, eval legends that name the estimator, the gold solutions'
log-likelihood beside its benchmark."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lspo_jax.job import plots

# Step 3 is logged twice (a resume after a crash re-ran it): the second record, loss 0.9, is the one kept.
TRAIN = [
    {"kind": "train", "step": 1, "loss": 0.5, "reward_mean": 0.1, "entropy": 5.59270001, "lr": 1e-6},
    {"kind": "train", "step": 2, "loss": 0.4, "reward_mean": 0.2, "entropy": 5.59270003, "lr": 2e-6},
    {"kind": "train", "step": 3, "loss": 0.3, "reward_mean": 0.3, "entropy": 5.59270002, "lr": 3e-6},
    {"kind": "train", "step": 3, "loss": 0.9, "reward_mean": 0.4, "entropy": 5.59270004, "lr": 3e-6},
    {"kind": "train", "step": 4, "loss": 0.2, "reward_mean": None, "entropy": 5.59270001, "lr": 3e-6},
]
EVAL = [
    {"kind": "eval", "step": 0, "benchmark": "math500", "accuracy": 0.25, "problems": 8, "pass@1": 0.5,
     "pass@1_unbiased": 0.25, "pass@4": 0.75, "pass@4_unbiased": 0.6},
    {"kind": "eval", "step": 0, "benchmark": "aime24", "accuracy": 0.1, "problems": 8, "pass@1": 0.125},
    {"kind": "eval", "step": 4, "benchmark": "math500", "accuracy": 0.5, "problems": 8, "pass@1": 0.625,
     "pass@1_unbiased": 0.5, "pass@4": 0.875, "pass@4_unbiased": 0.8},
]  # fmt: skip


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


def panels(fig) -> dict[str, tuple]:
    """Title -> the axes and its lines' (x, y) data."""
    return {ax.get_title(): (ax, [(line.get_xdata(), line.get_ydata()) for line in ax.lines]) for ax in fig.axes}


def test_plot_run_writes_both_pngs(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in TRAIN + EVAL))
    written = plots.plot_run(str(tmp_path))
    assert written == [str(tmp_path / "train_curves.png"), str(tmp_path / "eval_curves.png")]
    assert all((tmp_path / name).read_bytes()[:4] == b"\x89PNG" for name in ("train_curves.png", "eval_curves.png"))


def test_train_panels_are_the_keys_present():
    fig = plots.train_figure(TRAIN)
    assert set(panels(fig)) == {"policy loss", "reward (mean over rollouts)", "entropy", "learning rate"}
    assert plots.train_figure(EVAL) is None


def test_repeated_step_is_drawn_once_with_its_last_value():
    (raw_x, raw_y), (smooth_x, smooth_y) = panels(plots.train_figure(TRAIN))["policy loss"][1]
    np.testing.assert_array_equal(raw_x, [1, 2, 3, 4])
    np.testing.assert_allclose(raw_y, [0.5, 0.4, 0.9, 0.2])
    np.testing.assert_array_equal(smooth_x, raw_x)
    # Centred 3-point mean (h = 1 for 4 points), 2 points at the ends: (0.5+0.4)/2, (0.5+0.4+0.9)/3, ...
    np.testing.assert_allclose(smooth_y, [0.45, 0.6, 0.5, 0.55])
    # A null value leaves the step out of that panel only.
    (reward_x, _), _ = panels(plots.train_figure(TRAIN))["reward (mean over rollouts)"][1]
    np.testing.assert_array_equal(reward_x, [1, 2, 3])


def test_axes_have_integer_steps_and_no_offset():
    fig = plots.train_figure(TRAIN)
    fig.canvas.draw()
    ax, [(_, lr_y)] = panels(fig)["learning rate"]  # a schedule: raw points only, not smoothed
    np.testing.assert_allclose(lr_y, [1e-6, 2e-6, 3e-6, 3e-6])
    entropy = panels(fig)["entropy"][0]
    formatter = entropy.yaxis.get_major_formatter()
    assert formatter.get_useOffset() is False and formatter.get_offset() == ""
    assert all(float(t).is_integer() for t in entropy.get_xticks())


def test_eval_legend_names_the_estimator_in_percent():
    by_title = panels(plots.eval_figure(TRAIN + EVAL))
    assert set(by_title) == {"math500: held-out, 8 problems", "aime24: held-out, 8 problems"}
    ax, lines = by_title["math500: held-out, 8 problems"]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["accuracy (mean over samples)", "pass@1 (first-k)", "pass@1 (unbiased)", "pass@4 (first-k)",
                      "pass@4 (unbiased)"]  # fmt: skip
    np.testing.assert_allclose(lines[0][1], [25.0, 50.0])  # accuracy in percent, as the console prints it
    assert [line.get_linestyle() for line in ax.lines] == ["-", "-", "--", "-", "--"]
    aime = by_title["aime24: held-out, 8 problems"][0]
    assert [t.get_text() for t in aime.get_legend().get_texts()] == ["accuracy (mean over samples)", "pass@1 (first-k)"]


def test_gold_log_likelihood_panel_beside_its_benchmark():
    # math500's records carry the gold solutions' log-likelihood (8 solutions of 40 tokens in all: 5 a solution);
    # aime24's do not, so its row has the pass@k panel only.
    gold = [{**r, "gold_logprob": lp, "gold_logprob_seq": 5 * lp, "gold_solutions": 8, "gold_tokens": 40}
            if r["benchmark"] == "math500" else r for r, lp in zip(EVAL, (-1.5, None, -1.25), strict=True)]  # fmt: skip
    fig = plots.eval_figure(gold)
    by_title = panels(fig)
    assert list(by_title) == ["math500: held-out, 8 problems", "math500: 8 gold solutions",
                              "aime24: held-out, 8 problems"]  # fmt: skip
    ax, [(steps, values)] = by_title["math500: 8 gold solutions"]
    np.testing.assert_array_equal(steps, [0, 4])
    np.testing.assert_allclose(values, [-1.5, -1.25])  # nats per token, as recorded
    # The right axis reads per solution: 40 / 8 = 5 tokens a solution, so its limits are 5 times the left's.
    [right] = ax.child_axes
    fig.canvas.draw()
    assert right.get_ylabel() == "nats per solution"
    np.testing.assert_allclose(right.get_ylim(), 5 * np.array(ax.get_ylim()))
    # One row per benchmark: aime24 starts the second row, its gold cell left empty.
    aime = by_title["aime24: held-out, 8 problems"][0]
    assert (aime.get_subplotspec().rowspan.start, aime.get_subplotspec().colspan.start) == (1, 0)
    assert len(fig.axes) == 3


def test_plot_metrics_without_records_is_one_line(tmp_path, capsys):
    from tools import plot_metrics

    assert plot_metrics.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"plot_metrics: {tmp_path}: no metrics.jsonl to draw; give lspo-train's --out directory\n"
    )
    (tmp_path / "metrics.jsonl").write_text("")  # a run that has not logged its first step
    assert plot_metrics.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"plot_metrics: {tmp_path / 'metrics.jsonl'}: no training or validation records to draw\n"
    )
    assert list(tmp_path.iterdir()) == [tmp_path / "metrics.jsonl"]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in TRAIN))
    assert plot_metrics.main([str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"{tmp_path / 'train_curves.png'}\n"


def test_plot_metrics_says_it_left_out_a_cut_last_record(tmp_path, capsys):
    from tools import plot_metrics

    text = "".join(json.dumps(r) + "\n" for r in TRAIN)
    (tmp_path / "metrics.jsonl").write_text(text + '{"kind": "train", "step": 9, "loss"')  # killed mid-write
    assert plot_metrics.main([str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert err.startswith(f"plot_metrics: {tmp_path / 'metrics.jsonl'}: its last line was cut off mid-write"), err
