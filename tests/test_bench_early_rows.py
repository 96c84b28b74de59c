"""bench/bench_early_rows.py end to end on a small profile: one section per Zipf exponent in the
report, one run per exponent in the JSON, the shares within [0, 1]."""

import json
import os
import sys

# bench/ is a folder of the repository, not of the installed package (as in
# test_cluster_harness.py).
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from bench import bench_early_rows  # noqa: E402


def test_bench_early_rows_writes_a_section_per_zipf(tmp_path):
    report, results = tmp_path / "training.md", tmp_path / "early_rows.json"
    report.write_text("# Training\n\n## Another section\n\ntext\n")
    common = ["--ranks", "2", "--steps", "3", "--batch-size", "64", "--max-rows", "2000",
              "--report", str(report), "--json", str(results)]
    first = bench_early_rows.main([*common, "--zipf", "1.05"])
    bench_early_rows.main([*common, "--zipf", "0"])
    again = bench_early_rows.main([*common, "--zipf", "1.05"])  # replaces its own section
    text = report.read_text()
    assert text.count(bench_early_rows.section(1.05)) == 1
    assert text.count(bench_early_rows.section(0)) == 1
    assert "## Another section" in text
    runs = json.loads(results.read_text())["runs"]
    assert sorted(r["zipf"] for r in runs) == [0, 1.05]
    for r in (first, again):
        assert 0.0 <= r["early_share"] <= 1.0
        assert all(0.0 <= t["bags_late"] <= 1.0 and 0.0 <= t["rows_late"] <= 1.0
                   for t in r["tables"])
    assert first["tables"] == again["tables"]  # the same data, the same shares
