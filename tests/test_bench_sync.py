"""``tools/bench_sync.py`` on the tiny shape: both handover paths timed, and only the host one through host memory."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from tools.bench_sync import main  # noqa: E402


def test_bench_sync_tiny_reports_both_paths(tmp_path, capsys):
    out = tmp_path / "sync.json"
    assert main(["--shape", "tiny", "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    paths = result["paths"]
    assert set(paths) == {"host", "dlpack"}
    assert paths["dlpack"]["host_bytes"] == 0
    assert paths["host"]["host_bytes"] > 0
    assert paths["host"]["host_bytes"] == paths["host"]["tensor_bytes"]  # every tensor went through the host
    assert paths["dlpack"]["tensors_by_path"] == {"dlpack": paths["dlpack"]["tensors"], "host": 0}
    for path in paths.values():
        assert len(path["seconds"]) == 1 and path["median_s"] == path["min_s"] > 0
        assert path["tensors"] > 0
    assert result["host_over_dlpack_median"] > 0
    assert "host / dlpack" in capsys.readouterr().out


def test_bench_sync_refuses_zero_repeats():
    with pytest.raises(SystemExit) as exc:
        main(["--shape", "tiny", "--repeats", "0"])
    assert exc.value.code == 2
