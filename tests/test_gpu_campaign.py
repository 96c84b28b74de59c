"""The GPU campaign (`make gpu-campaign`, docs/gpu.md) proven without a GPU: its dry run end to
end, and the pieces that read what a GPU run produces (trace overlap, junit counts, report)."""

import hashlib
import json
import os
import random
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.gpu_campaign import report, stages, trace_overlap  # noqa: E402
from recxla.train.kernel_trace import rank_path  # noqa: E402


def _random_trace(rng: random.Random):
    events = []
    for stream in (7, 13, 21):
        t = rng.randrange(0, 50)
        for _ in range(rng.randrange(1, 30)):
            dur = rng.randrange(1, 40)
            cat = rng.choice(["kernel", "kernel", "gpu_memcpy"]) if stream != 7 else "kernel"
            events.append({"ph": "X", "cat": cat, "name": "k", "ts": t, "dur": dur,
                           "args": {"stream": stream, "device": 0}})
            t += dur + rng.randrange(-dur, 30)  # overlapping events on one stream too
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 0, "dur": 10**6,
                   "args": {}})  # host events never count
    return {"traceEvents": events}


def _busy_grid(events, stream):
    return {t for e in events if e.get("cat") in trace_overlap.DEVICE_CATEGORIES
            and e["args"]["stream"] == stream for t in range(e["ts"], e["ts"] + e["dur"])}


def test_stream_overlap_matches_a_time_grid(seed):
    rng = random.Random(seed)
    for _ in range(20):
        trace = _random_trace(rng)
        found = trace_overlap.stream_overlap(trace)
        events = trace["traceEvents"]
        kernel = {s: sum(e["dur"] for e in events if e.get("cat") == "kernel"
                         and e["args"]["stream"] == s) for s in (7, 13, 21)}
        compute = max(kernel, key=kernel.get)
        assert found["compute_stream"] == f"0:{compute}"
        busy = {s: _busy_grid(events, s) for s in (7, 13, 21)}
        side = set()
        for s in found["streams"]:
            number = int(s["stream"].split(":")[1])
            assert s["busy_us"] == len(busy[number])
            assert s["overlapped_us"] == len(busy[number] & busy[compute])
            side |= busy[number]
        assert found["side"]["busy_us"] == len(side)
        assert found["side"]["overlapped_us"] == len(side & busy[compute])


def test_stream_overlap_of_a_cpu_trace_is_absent_not_zero():
    found = trace_overlap.stream_overlap({"traceEvents": [{"ph": "X", "cat": "cpu_op",
                                                           "ts": 0, "dur": 5}]})
    assert found["compute_stream"] is None and found["side"]["share"] is None


def test_kernel_trace_rank_paths():
    assert rank_path("t.json.gz", 0) == "t.json.gz"
    assert rank_path("t.json.gz", 3) == "t.rank3.json.gz"
    assert rank_path("out/t.json", 1) == "out/t.rank1.json"
    assert rank_path("trace", 2) == "trace.rank2"


def test_junit_counts(tmp_path):
    path = tmp_path / "j.xml"
    path.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.a" name="ok"/>'
        '<testcase classname="tests.a" name="bad"><failure message="x"/></testcase>'
        '<testcase classname="tests.b" name="boom"><error message="y"/></testcase>'
        '<testcase classname="tests.b" name="later"><skipped message="z"/></testcase>'
        '</testsuite></testsuites>')
    counts = stages.junit_counts(str(path))
    assert counts == {"tests": 4, "passed": 1, "failures": 1, "errors": 1, "skipped": 1,
                      "failed_names": ["tests.a::bad", "tests.b::boom"],
                      "outcomes": {"tests.a::ok": "passed", "tests.a::bad": "failure",
                                   "tests.b::boom": "error", "tests.b::later": "skipped"}}
    log = ("tests/a.py::ok PASSED [ 25%]\ntests/a.py::bad FAILED [ 50%]\n"
           "tests/b.py::boom ERROR [ 75%]\ntests/b.py::later SKIPPED (why) [100%]\n")
    assert stages.verbose_counts(log) == counts  # a run cut at its budget, read from its log
    assert stages.junit_counts(str(tmp_path / "missing.xml"))["tests"] == 0


def test_kernel_targets_read_the_rows():
    rows = [
        {"group": "fp8_quantize 65536x128", "provider": "cuda:a", "median_us": 20.0,
         "min_us": 19.0, "of_copy": 0.9, "check": "exact"},
        {"group": "fp8_quantize 65536x128", "provider": "cuda:b", "median_us": 10.0,
         "min_us": 9.0, "of_copy": 1.8, "check": "FAILED: differs"},
        {"group": "dedup criteo zipf", "provider": "cuda:x", "median_us": 100.0, "min_us": 90.0,
         "check": "exact"},
        {"group": "dedup criteo zipf", "provider": "torch.unique", "median_us": 250.0,
         "min_us": 240.0, "check": "baseline"},
        {"group": "cluster batch 8192 M=4", "provider": "cuda:fused", "median_us": 700.0,
         "min_us": 650.0, "check": "exact"},
    ]
    found = {t.split(":")[0]: (measured, met) for t, measured, met in report.kernel_targets(rows)}
    assert found["codec >= 0.85x copy bandwidth"] == ("cuda:a 0.90x", True)  # b failed its check
    assert found["dedup >= 2.0x torch.unique"] == ("cuda:x 2.50x", True)
    assert found["clustering <= 0.5 ms"] == ("cuda:fused 700.0 us", False)


def test_back_to_back_time_beside_each_call_and_against_the_copy():
    """time_calls times the same calls back to back too (on CPU with the host clock, the GPU's
    code path), and the report sets each provider's back-to-back time against its group's
    device copy's."""
    import torch

    from bench.gpu_campaign.timing import DEVICE_COPY, row, time_calls

    calls = []
    timing = time_calls(lambda x: calls.append(x.sum()), [(torch.ones(64),)], warmup=2,
                        iters=5, device="cpu")
    assert len(calls) == 2 + 5 + 5 and timing["back_to_back_us"] > 0
    assert row("g", "p", timing)["back_to_back_us"] == round(timing["back_to_back_us"], 2)
    rows = [row("g", DEVICE_COPY, {"median_us": 30.0, "min_us": 29.0, "back_to_back_us": 8.0},
                check="baseline"),
            row("g", "cuda:a", {"median_us": 32.0, "min_us": 31.0, "back_to_back_us": 10.0}),
            row("g", "triton", {"median_us": 40.0, "min_us": 39.0})]  # timed before the column
    table = "\n".join(report._kernel_tables({"rows": rows}))
    assert "| cuda:a | 32.0 us | 31.0 us | - | - | 10.0 us | 0.8 | exact |" in table
    assert "| device copy | 30.0 us | 29.0 us | - | - | 8.0 us | 1.0 | baseline |" in table
    assert "| triton | 40.0 us | 39.0 us | - | - | - | - | exact |" in table


def _run(date, stages_):
    return {"date": date, "commit": date, "dry_run": False, "machine": {}, "command": "",
            "stages": stages_}


def test_a_rerun_replaces_only_what_it_ran():
    def tests(outcomes):
        data = stages.count_outcomes(outcomes)
        return {"status": "fail" if data["failed_names"] else "pass", "summary": "",
                "seconds": 1, "data": data}

    def kernels(rows, choices):
        return {"status": "pass", "summary": "", "seconds": 1,
                "data": {"rows": rows, "choices": choices}}

    row = lambda g, p, t: {"group": g, "provider": p, "median_us": t, "min_us": t,  # noqa
                           "check": "exact"}
    first = _run("1", {
        "tests-cuda": tests({"t::a": "passed", "t::b": "failure", "t::c": "passed"}),
        "kernels": kernels([row("fp8 x", "cuda:a", 3.0), row("dedup y", "cuda:b", 5.0)],
                           [{"family": "fp8", "winner": "a"}, {"family": "dedup", "winner": "b"}]),
        "trainer": {"status": "fail", "summary": "broken", "seconds": 1, "data": {}}})
    rerun = _run("2", {
        "tests-cuda": tests({"t::b": "passed"}),
        "kernels": kernels([row("fp8 x", "cuda:a", 2.0)], [{"family": "fp8", "winner": "c"}]),
        "trainer": {"status": "skip", "summary": "not run", "seconds": 0}})
    view = report.merged([first, rerun])["stages"]
    assert view["tests-cuda"]["status"] == "pass"
    assert view["tests-cuda"]["data"]["outcomes"] == {"t::a": "passed", "t::b": "passed",
                                                      "t::c": "passed"}
    assert sorted((r["group"], r["median_us"]) for r in view["kernels"]["data"]["rows"]) == [
        ("dedup y", 5.0), ("fp8 x", 2.0)]
    assert {c["family"]: c["winner"] for c in view["kernels"]["data"]["choices"]} == {
        "fp8": "c", "dedup": "b"}
    assert view["trainer"]["summary"] == "broken" and view["trainer"]["run"] == "1, 1"


def _digest(path):
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


@pytest.mark.timeout(900)
def test_campaign_dry_run(tmp_path):
    """Every stage that needs no GPU runs and passes; the report is written to the output
    folder only (a dry run's CPU figures never reach bench/results)."""
    before = _digest(report.RESULTS_JSON), _digest(report.RESULTS_MD)
    out = tmp_path / "campaign"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_campaign", "--dry-run", "--out",
                           str(out), "--deadline", "850"], cwd=ROOT, capture_output=True,
                          text=True, timeout=880)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert (_digest(report.RESULTS_JSON), _digest(report.RESULTS_MD)) == before
    # What comes back from a GPU machine: at most 8 plain files, no folder.
    assert sorted(os.listdir(out)) == ["campaign.log", "gpu.json", "gpu.md",
                                       "kernel_trace.json.gz", "logs.tar.gz", "summary.txt"]
    with open(out / "gpu.json") as f:
        run = json.load(f)["runs"][-1]
    assert run["dry_run"]
    assert {name: s["status"] for name, s in run["stages"].items()} == {
        name: "pass" for name in ("env", "build", "tests-cuda", "tests-triton", "memcheck",
                                  "racecheck", "kernels", "trainer")}
    kernels = run["stages"]["kernels"]["data"]
    families = {r["group"].split()[0] for r in kernels["rows"]}
    assert {"fp8_quantize", "fp8_dequantize", "dedup", "cluster", "embedding-bag"} <= families
    assert not [r for r in kernels["rows"] if r["check"].startswith("FAILED")]
    from recxla.ops import gpu_variants

    assert {"dedup", "cluster", "embedding_update"} <= {c["family"] for c in kernels["choices"]}
    assert {f"recxla-cuda:{v}" for v in gpu_variants.variants("embedding_update")} <= {
        r["provider"] for r in kernels["rows"] if r["group"].startswith("embedding-bag")}
    trainer = run["stages"]["trainer"]["data"]
    assert max(trainer["relative_differences"].values()) <= 1e-4
    text = (out / "gpu.md").read_text()
    assert "dry run on CPU" in text and "## Targets" in text
    assert "campaign (dry run (CPU))" in proc.stdout.splitlines()[-1]


def test_trainer_runs_the_features_alone_only_where_pipelined_differs(tmp_path, monkeypatch):
    """The trainer stage's comparison on made-up runs: equal runs pass with five runs (three of
    DLRM, two of the sequence model); a pipelined run that differs fails and runs
    micro-batches and DBP alone, naming which one differs from the sequential run."""
    import random

    from bench.gpu_campaign import trainer

    loss = random.uniform(0.4, 0.7)
    for broken in (None, "--micro-batches 2 --no-overlap", "--dbp"):
        made = []

        def fake_run(name, args, work, nproc, timeout):
            made.append(name)
            line = " ".join(args)
            pipelined = "--micro-batches 2 --overlap --dbp" in line
            off = broken is not None and (pipelined or broken in line and (
                broken != "--dbp" or "--micro-batches 1 --overlap --dbp" in line))
            value = loss * (1.01 if off else 1.0)
            return {"returncode": 0, "final_loss": value, "eval_loss": value, "auc": 0.7,
                    "examples_per_s": 1000.0}

        monkeypatch.setattr(trainer, "_run", fake_run)
        out = tmp_path / "trainer.json"
        code = trainer.main(["--out", str(out), "--work", str(tmp_path)])
        with open(out) as f:
            result = json.load(f)
        if broken is None:
            assert code == 0 and result["status"] == "pass" and len(made) == 5
            assert "features_alone" not in result
            continue
        assert code == 1 and result["status"] == "fail"
        assert made[5:] == list(trainer.FEATURES_ALONE)
        alone = result["features_alone"]
        culprit = "dbp alone" if broken == "--dbp" else "micro-batches alone"
        assert alone[culprit] > 1e-3, alone
        assert all(d == 0 for name, d in alone.items() if name != culprit), alone
        assert f"{culprit} 9.9e-03" in result["summary"], result["summary"]
