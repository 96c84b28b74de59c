"""The cluster benchmark's results as history (bench/cluster/history.py) and the results page
generated from it (bench/cluster/train_report.py): the committed page is what the committed
history files generate, run_train appends a sitting instead of writing a copy, and the tables
say what they compute."""

import json
import os
import random
import re

import pytest

from bench.cluster import history, run_train, train_report


def test_committed_page_is_what_the_history_generates():
    with open(train_report.PAGE) as f:
        text = f.read()
    assert text.count("<!-- table ") == text.count("<!-- end table -->") >= 20
    assert train_report.SITTINGS_BEGIN in text
    assert train_report.render(text, train_report.histories()) == text, (
        "bench/results/training.md's generated parts are out of date: run "
        "`python -m bench.cluster.train_report`")


def test_results_keep_one_history_file_per_cluster_shape():
    """No copy per sitting: every training JSON in bench/results is a shape's history, and each
    entry says which commit, when, on what machine and by which command."""
    names = sorted(n for n in os.listdir(history.RESULTS_DIR)
                   if n.startswith("training") and n.endswith(".json"))
    assert names and all(re.fullmatch(r"training_\d+x\d+\.json", n) for n in names)
    for name, hist in train_report.histories().items():
        nodes, ranks = map(int, name[len("training_"):].split("x"))
        assert hist["description"] and hist["runs"]
        for e in hist["runs"]:
            assert e["commit"] and e["date"].endswith(" UTC") and e["machine"]["cpu"]
            assert e["command"].startswith("python -m bench.cluster.run_train")
            summaries = [s for r in e["results"] for v in r["runs"].values() for s in v]
            assert summaries and all(
                s["nodes"] == nodes and s["world_size"] == nodes * ranks for s in summaries)
        dates = [e["date"] for e in hist["runs"]]
        assert dates == sorted(dates), f"{name}: entries not newest last"


def _summary(eps: float, cpu_us: float = 100.0) -> dict:
    return {"examples_per_s": eps, "auc": 0.7, "exposed_comm_fraction": 0.25,
            "step_time_s": {"mean": 4096 / eps, "compute": 0.1, "comm_in_flight": 0.08,
                            "exposed_comm": 0.02, "data": 0.0},
            "wire_bytes_per_step": 9.09e6, "cross_node_bytes_per_step": 4.07e6,
            "iface_tx_bytes_per_step": 4.1e6, "nodes": 2, "world_size": 4,
            "wire_bytes_per_step_by_kind": {"embeddings_fwd": 1.3e6, "embeddings_bwd": 1.3e6,
                                            "ids": 0.47e6},
            "cpu_us_per_example": {"mean": cpu_us}}


def _sitting(commit: str, fp32: list, bf16ar: list, dbp: list) -> dict:
    rows = {"torchrec fp32": [_summary(x) for x in fp32],
            "torchrec bf16+AR": [_summary(x) for x in bf16ar],
            "recxla DBP": [_summary(x) for x in dbp]}
    return history.entry("python -m bench.cluster.run_train --rates 1gbit",
                         {"cpu": "Test CPU", "cores": 2, "kernel": "k", "commit": "ignored",
                          "loadavg_1m": 1.0, "loadavg_1m_before": 0.5}, 12.0,
                         [{"rate": "1gbit", "mode": "netns", "fallback_reason": None,
                           "fastest_torchrec": "torchrec bf16+AR", "runs": rows}],
                         commit=commit, date="2026-12-01 10:00 UTC")


def test_table_gives_medians_and_ratios_to_the_fastest_torchrec():
    fp32 = [random.uniform(4000, 6000) for _ in range(3)]
    bf16ar = [random.uniform(7000, 9000) for _ in range(3)]
    dbp = [random.uniform(15000, 20000) for _ in range(3)]
    med = lambda xs: sorted(xs)[1]  # noqa: E731
    text = train_report.table("training_2x2", _sitting("abc1234", fp32, bf16ar, dbp), "1gbit")
    caption, _, head, _, *rows = text.split("\n")
    assert "`training_2x2.json`, abc1234, 2026-12-01 10:00 UTC: medians of 3 runs" in caption
    assert head.split(" | ")[1:4] == ["ex/s", "vs best TR", "vs TR fp32"]
    cells = {r.strip("| ").split(" | ")[0]: r.strip("| ").split(" | ")[1:] for r in rows}
    assert cells["recxla DBP"][:3] == [f"{med(dbp):,.0f}", f"**{med(dbp) / med(bf16ar):.2f}x**",
                                       f"{med(dbp) / med(fp32):.2f}x"]
    assert cells["torchrec bf16+AR"][1] == "1.00x" and "**" not in "".join(cells["torchrec fp32"])
    # CPU us/example, exposed, wire and across-node MB
    assert cells["recxla DBP"][5:] == ["100.0", "25%", "9.09", "4.07"]
    picked = train_report.table("training_2x2", _sitting("abc1234", [1000], [2000], [3000]),
                                "1gbit", ("runs", "xnode_link", "emb", "ids"))
    assert picked.split("\n")[0].endswith("one run per variant; bold: the fastest recxla variant.")
    assert "| recxla DBP | 3,000 | 4.07 / 4.10 | 1.30 / 1.30 | 0.47 |" in picked


def test_over_the_dense_floor_is_the_cpu_above_the_floor_run():
    entry = _sitting("abc1234", [1000], [2000], [3000])
    rows = entry["results"][0]["runs"]
    floor_cpu, dbp_cpu = random.uniform(30, 50), random.uniform(60, 120)
    rows["recxla DBP"] = [_summary(3000, dbp_cpu)]
    columns = ("cpu", "floor")
    without = train_report.table("training_2x2", entry, "1gbit", columns)
    assert "| recxla DBP | " + f"{dbp_cpu:.1f} | - |" in without  # no floor run: no figure
    rows[train_report.DENSE_FLOOR] = [_summary(40000, floor_cpu)]
    text = train_report.table("training_2x2", entry, "1gbit", columns)
    assert f"| recxla DBP | {dbp_cpu:.1f} | {dbp_cpu - floor_cpu:.1f} |" in text
    assert f"| dense floor | {floor_cpu:.1f} | 0.0 |" in text
    # The floor is neither the fastest TorchRec nor the fastest recxla variant.
    assert train_report.fastest_torchrec(rows) == "torchrec bf16+AR"


def test_table_errors_name_what_is_missing():
    entry = _sitting("abc1234", [1000], [2000], [3000])
    with pytest.raises(KeyError, match=r"unknown column 'speed': one of eps, runs"):
        train_report.table("training_2x2", entry, "1gbit", ("eps", "speed"))
    with pytest.raises(KeyError, match=r"ran no rate '200mbit': it ran 1gbit"):
        train_report.table("training_2x2", entry, "200mbit")
    runs = [entry, _sitting("def5678", [1], [2], [3]), _sitting("abc1234", [5], [6], [7])]
    assert history.select(runs, "abc1234") is runs[0]
    assert history.select(runs, "abc1234#2") is runs[2]
    with pytest.raises(KeyError, match=r"no entry 'abc1234#3': 2 with commit 'abc1234' "
                                       r"\(commits on record: abc1234, def5678\)"):
        history.select(runs, "abc1234#3")


def test_run_train_appends_the_sitting_and_regenerates_the_page(tmp_path, monkeypatch):
    """A sitting is appended (newest last, commit from RECXLA_COMMIT, machine without its own
    commit), the file keeps one trainer summary per line, and a page naming the entries in
    markers is regenerated from the histories of its folder."""
    monkeypatch.setattr(history, "RESULTS_DIR", str(tmp_path))
    page = tmp_path / "training.md"
    monkeypatch.setattr(train_report, "PAGE", str(page))
    monkeypatch.setenv("RECXLA_COMMIT", "feed123+")
    path = history.path_for(2, 2)
    assert path == str(tmp_path / "training_2x2.json")
    first = _sitting(None, [1000, 1100], [2000, 2100], [3000, 3300])  # commit: run_commit()
    assert first["commit"] == "feed123+" and "commit" not in first["machine"]
    page.write_text("# Page\n\nhand-written\n\n<!-- sittings: begin -->\nstale\n"
                    "<!-- sittings: end -->\n\n<!-- table training_2x2 feed123+ 1gbit eps,best -->"
                    "\nstale\n<!-- end table -->\nhand-written too\n")
    run_train.record(path, first)
    run_train.record(path, _sitting("beef456", [1000], [4000], [3000]))
    doc = history.load(path)
    assert [e["commit"] for e in doc["runs"]] == ["feed123+", "beef456"]
    assert doc["description"] == history.DESCRIPTION
    lines = open(path).read().split("\n")
    assert sum(ln.lstrip().startswith('{"examples_per_s"') for ln in lines) == 2 * 3 + 3
    assert json.loads(open(path).read()) == doc
    text = page.read_text()
    assert "stale" not in text and text.startswith("# Page\n\nhand-written\n")
    assert text.endswith("<!-- end table -->\nhand-written too\n")
    assert "| recxla DBP | 3,150 | **1.54x** |" in text  # medians 3,150 against 2,050
    assert "| training_2x2 | 2026-12-01 10:00 UTC | beef456 |" in text
    assert "1gbit: recxla DBP 0.75x torchrec bf16+AR |" in text
    assert train_report.main(["--check", "--page", str(page), "--results", str(tmp_path)]) == 0
    page.write_text(text.replace("3,150", "3,151"))
    assert train_report.main(["--check", "--page", str(page), "--results", str(tmp_path)]) == 1


def test_run_train_refuses_a_file_that_is_not_a_history_before_running(tmp_path, capsys):
    old = tmp_path / "training_2x2_abc1234.json"
    old.write_text(json.dumps({"command": "x", "machine": {}, "results": []}))
    with pytest.raises(SystemExit) as exit_info:
        run_train.main(["--json", str(old), "--variants", "recxla DBP"])
    assert exit_info.value.code == 2
    assert "is not a results history" in capsys.readouterr().err
    with pytest.raises(ValueError, match="is not JSON"):
        (tmp_path / "bad.json").write_text("{")
        history.load(str(tmp_path / "bad.json"))


def test_a_variants_shared_setup_is_kept_once(tmp_path):
    """What every repeat of a variant shares (config, plan, command line, ...) is stored once in
    the history's setups, named by the rate's setup; expanded() gives every summary whole
    again, compacting twice changes nothing, and the report's tables are the same."""
    import copy

    entry = _sitting("abc1234", [1000, 1100], [2000, 2100], [3000, 3300])
    plan = {f"t{i}": {"sharding": random.choice(["table_wise", "row_wise"])} for i in range(26)}
    rows = entry["results"][0]["runs"]
    for variant, summaries in rows.items():
        for k, s in enumerate(summaries):
            s.update(plan=plan, config={"seed": 0, "label": variant}, argv=["--label", variant],
                     machine={"loadavg_1m": random.random()})  # not shared: stays
    rows["recxla DBP"][1]["argv"] = ["--other"]  # differs between repeats: stays too
    doc = {"description": "d", "runs": [copy.deepcopy(entry), copy.deepcopy(entry)]}
    table = train_report.table("training_2x2", doc["runs"][0], "1gbit")
    history.compact(doc)
    assert len(doc["setups"]) == 3  # one a variant, the same in both sittings
    rate = doc["runs"][0]["results"][0]
    assert rate["setup"] == doc["runs"][1]["results"][0]["setup"]
    for variant, summaries in rate["runs"].items():
        assert all("plan" not in s and "config" not in s and "machine" in s for s in summaries)
        assert ("argv" in summaries[0]) == (variant == "recxla DBP")
    for e in doc["runs"]:
        assert history.expanded(doc, e["results"][0]) == rows
    again = copy.deepcopy(doc)
    assert history.compact(again) == doc
    assert train_report.table("training_2x2", doc["runs"][0], "1gbit") == table
    path = tmp_path / "training_2x2.json"
    history.write(str(path), doc)
    assert history.load(str(path)) == doc
