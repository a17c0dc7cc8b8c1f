"""``tools/same_records.py``: two folders of runs compared record by record, timings left out, on constructed
records."""

from __future__ import annotations

import json

from tools import same_records as tool


def _write(root, case, records):
    (root / case).mkdir(parents=True)
    (root / case / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_timings_differ_and_the_runs_are_still_the_same(tmp_path, capsys):
    before = [{"step": 1, "loss": 0.5, "time_step": 1.0, "rollout/push_s": 0.1, "compiles": 3}]
    after = [{"step": 1, "loss": 0.5, "time_step": 2.5, "rollout/push_s": 0.4, "compiles": 4}]
    _write(tmp_path / "a", "demo", before)
    _write(tmp_path / "b", "demo", after)
    assert tool.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "demo: 1 records, 2 values compared: identical" in out and "split: not in both folders" in out


def test_a_changed_value_or_a_missing_record_is_a_difference(tmp_path, capsys):
    _write(tmp_path / "a", "stale", [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.4}])
    _write(tmp_path / "b", "stale", [{"step": 1, "loss": 0.5000001}])
    assert tool.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    out = capsys.readouterr().out
    assert "stale: 2 records, 4 values compared: 2 differences: 2 records before, 1 after; " in out
    assert "record 0: loss 0.5 -> 0.5000001" in out
