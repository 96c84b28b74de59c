"""recxla-train end to end: 2 gloo ranks for a few steps, recxla and the TorchRec baseline, the
metrics file, --compare, and options rejected before any process group exists.

`launch_ranks` (used by the other tests/test_train_*.py files too) starts the ranks the way
torchrun does, by environment variables, but as plain processes: a test can then kill or stop
one of them. They are forked from an interpreter that has imported the trainer already
(tests/warm_ranks.py), except where a fork would differ (`_needs_a_fresh_process`); the
end-to-end test here starts them with torchrun.
"""

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Union

import pytest
from warm_ranks import WarmRank

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The ranks import recxla from this checkout, and whatever the caller's PYTHONPATH adds after it
# (a GPU machine may carry TorchRec in a folder of its own).
RANK_PYTHONPATH = os.pathsep.join(
    [REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
# A model small enough for a few steps in seconds on 2 shared cores.
SMALL = ["--profile", "small", "--batch-size", "128", "--embedding-dim", "16",
         "--dense-arch", "32", "--over-arch", "32", "--eval-batches", "2", "--no-progress"]
REQUIRED = ("examples_per_s", "exposed_comm_fraction", "wire_bytes_per_step", "final_loss", "auc")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Rank:
    proc: Union[WarmRank, subprocess.Popen]
    log: str

    def output(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()


# Read when a process starts or a library loads (the C library's malloc, the dynamic loader,
# OpenMP when torch loads it), never again: a forked rank would run with the forkserver's values.
_READ_AT_EXEC = ("GLIBC_TUNABLES", "LD_PRELOAD", "MALLOC_ARENA_MAX", "OMP_NUM_THREADS")


def _needs_a_fresh_process(args: Sequence[str], env: Dict[str, str]) -> bool:
    """A GPU rank (a process forked after the server's imports may find the CUDA driver unusable:
    "Cannot re-initialize CUDA in forked subprocess"), or one whose environment sets a variable
    that only a new process reads."""
    return any("cuda" in a for a in args) or any(name in env for name in _READ_AT_EXEC)


def start_ranks(args: Sequence[str], tmp_path, world_size: int = 2,
                env: Optional[Dict[str, str]] = None,
                ranks_per_node: Optional[int] = None) -> List[Rank]:
    """Start `python -m recxla.train ARGS` as `world_size` ranks, of one node or of nodes of
    `ranks_per_node` as torchrun numbers them (rank 0 hosts the store); each rank's stdout and
    stderr go to tmp_path/rank<r>.log."""
    port = _free_port()
    per_node = ranks_per_node or world_size
    ranks = []
    for r in range(world_size):
        e = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world_size), LOCAL_RANK=str(r % per_node),
                 LOCAL_WORLD_SIZE=str(per_node), MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port), PYTHONPATH=RANK_PYTHONPATH, **(env or {}))
        log = str(tmp_path / f"rank{r}.log")
        if _needs_a_fresh_process(args, env or {}):
            with open(log, "w") as out:
                proc = subprocess.Popen([sys.executable, "-m", "recxla.train", *args], env=e,
                                        cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        else:
            open(log, "w").close()
            proc = WarmRank(args, e, REPO, log)
        ranks.append(Rank(proc, log))
    return ranks


def wait_ranks(ranks: List[Rank], timeout: float) -> List[int]:
    """Exit codes of `ranks`; kills them all and fails the test past `timeout` seconds."""
    deadline = time.monotonic() + timeout
    try:
        return [r.proc.wait(timeout=max(deadline - time.monotonic(), 0.1)) for r in ranks]
    except subprocess.TimeoutExpired:
        pytest.fail("ranks did not finish in time:\n" + "\n".join(r.output()[-2000:]
                                                                   for r in ranks))
    finally:
        for r in ranks:
            if r.proc.poll() is None:
                r.proc.kill()
                r.proc.wait()


def launch_ranks(args: Sequence[str], tmp_path, world_size: int = 2, timeout: float = 150.0,
                 env=None, ranks_per_node: Optional[int] = None) -> List[Rank]:
    """Run the trainer on `world_size` ranks (start_ranks) to the end; fails the test unless
    all exit 0."""
    ranks = start_ranks(args, tmp_path, world_size, env, ranks_per_node)
    codes = wait_ranks(ranks, timeout)
    if any(codes):
        pytest.fail(f"exit codes {codes}:\n" + "\n".join(r.output()[-3000:] for r in ranks))
    return ranks


def check_metrics(path, world_size: int, steps: int, warmup: int) -> dict:
    with open(path) as f:
        m = json.load(f)
    for key in REQUIRED:
        assert key in m, key
    assert m["world_size"] == world_size
    assert m["measured_steps"] == steps - warmup
    assert m["examples_per_s"] > 0 and m["examples_per_s_p50"] > 0
    t = m["step_time_s"]
    assert t["mean"] > 0 and 0 <= t["exposed_comm"] <= t["rank_mean"]
    assert t["compute"] + t["data"] + t["exposed_comm"] == pytest.approx(t["rank_mean"])
    assert 0 <= m["exposed_comm_fraction"] < 1
    assert 0.3 < m["final_loss"] < 1.5  # BCE of a ~25%-positive task
    assert 0.0 <= m["auc"] <= 1.0 and m["eval_examples"] == world_size * 2 * 128
    # each rank's process CPU time per step, over the ranks; per example = per step / samples
    cpu = m["cpu_s_per_step"]
    assert 0 < cpu["p50"] <= cpu["p50_max_rank"] and 0 < cpu["mean"] <= cpu["mean_max_rank"]
    assert m["cpu_us_per_example"]["mean"] * m["config"]["batch_size"] == pytest.approx(
        cpu["mean"] * 1e6)
    assert m["cpu_cores_per_rank"] == pytest.approx(cpu["mean"] / t["rank_mean"])
    return m


def crossing_rows(m: dict) -> int:
    """Pooled-embedding rows that cross between the 2 ranks per step under table-wise sharding:
    every table's owner sends the other rank its B samples' rows."""
    return sum(m["config"]["batch_size"] for table in m["plan"].values() for _ in table["ranks"])


def test_dense_floor_sends_only_the_dense_gradients(tmp_path):
    """--dense-floor: the model without its embedding work, trained to the end (checkpoint
    and evaluation included), with nothing on the wire but the dense all-reduce."""
    steps, warmup = 4, 1
    launch_ranks([*SMALL, "--steps", str(steps), "--warmup-steps", str(warmup), "--baseline",
                  "torchrec", "--dense-floor", "--dense-allreduce", "bf16", "--checkpoint-dir",
                  str(tmp_path / "ck"), "--metrics", str(tmp_path / "floor.json")], tmp_path)
    floor = check_metrics(tmp_path / "floor.json", 2, steps, warmup)
    assert set(floor["wire_bytes_per_step_by_kind"]) == {"dense_allreduce"}, floor
    assert floor["config"]["dense_floor"] is True


def test_recxla_and_baseline_end_to_end(tmp_path):
    steps, warmup = 6, 2
    common = [*SMALL, "--steps", str(steps), "--warmup-steps", str(warmup),
              "--sharding", "table_wise"]
    # The recxla path through torchrun itself (its store, its variables).
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "recxla.train", *common, "--row-exchange", "off",  # pooled bags' arithmetic
         "--metrics", str(tmp_path / "recxla.json")],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=RANK_PYTHONPATH), capture_output=True, text=True,
        timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "examples/s" in proc.stdout and "AUC" in proc.stdout
    ranks = launch_ranks([*common, "--baseline", "torchrec", "--baseline-comms", "bf16",
                          "--ddp-bucket-mb", "0.01", "--metrics", str(tmp_path / "torchrec.json")],
                         tmp_path)
    assert "exposed comm" in ranks[0].output() and "CPU/example" in ranks[0].output()

    rx = check_metrics(tmp_path / "recxla.json", 2, steps, warmup)
    tr = check_metrics(tmp_path / "torchrec.json", 2, steps, warmup)
    assert rx["path"] == "recxla" and tr["path"] == "torchrec"
    assert tr["config"]["ddp_bucket_mb"] == 0.01 and rx["config"]["ddp_bucket_mb"] == 1.0
    assert rx["plan"] == tr["plan"]  # the same plan for both paths
    assert all(t["sharding"] == "table_wise" for t in rx["plan"].values())
    # Bytes on the wire, counted by the meter, against the layout's arithmetic.
    dim = rx["config"]["embedding_dim"]
    # the defaults: e4m3 rows forward and e5m2 rows backward, dim codes + a 4-byte scale each
    for kind in ("embeddings_fwd", "embeddings_bwd"):
        assert rx["wire_bytes_per_step_by_kind"][kind] == pytest.approx(
            crossing_rows(rx) * (dim + 4))
        # TorchRec's bf16 codec both ways: 2 bytes a value
        assert tr["wire_bytes_per_step_by_kind"][kind] == pytest.approx(
            crossing_rows(tr) * dim * 2)
    # The dense all-reduce: the same replicated MLPs on both paths, in bf16 on recxla's (its
    # default) and fp32 on TorchRec's (its default).
    assert rx["config"]["dense_allreduce"] == "bf16" and tr["config"]["dense_allreduce"] == "fp32"
    assert 2 * rx["wire_bytes_per_step_by_kind"]["dense_allreduce"] == \
        tr["wire_bytes_per_step_by_kind"]["dense_allreduce"] > 0
    # recxla's own counters agree with the meter, and dedup sent fewer id bytes.
    stats = rx["sharder_comm_stats_per_step"]
    assert stats["embedding_bytes_sent"] == pytest.approx(
        rx["wire_bytes_per_step_by_kind"]["embeddings_fwd"])
    assert stats["id_bytes_sent"] < stats["id_bytes_without_dedup"]

    out = subprocess.run(
        [sys.executable, "-m", "recxla.train", "--compare", str(tmp_path / "torchrec.json"),
         str(tmp_path / "recxla.json"), "--chart", str(tmp_path / "c.png")],
        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "torchrec bf16/bf16" in out.stdout and "recxla e4m3/e5m2" in out.stdout
    assert "CPU us/example" in out.stdout
    with open(tmp_path / "c.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_history_model_end_to_end(tmp_path):
    """--model history on both paths, one plan: recxla's sequence module counts its bytes by
    kind, and sends fewer row bytes than TorchRec's bf16 sequence all-to-all (each row once a
    rank, 1 + 4/dim bytes a value, against one row per id at 2 bytes a value)."""
    steps, warmup = 5, 1
    common = [*SMALL, "--model", "history", "--steps", str(steps), "--warmup-steps",
              str(warmup), "--sharding", "table_wise"]
    launch_ranks([*common, "--row-exchange", "off", "--metrics", str(tmp_path / "recxla.json")],
                 tmp_path)
    launch_ranks([*common, "--baseline", "torchrec", "--baseline-comms", "bf16",
                  "--metrics", str(tmp_path / "torchrec.json")], tmp_path)
    rx = check_metrics(tmp_path / "recxla.json", 2, steps, warmup)
    tr = check_metrics(tmp_path / "torchrec.json", 2, steps, warmup)
    assert rx["plan"] == tr["plan"] and "t_cat_11" in rx["plan"]
    dim, history = rx["config"]["embedding_dim"], "t_cat_11"
    pooled = {t: p for t, p in rx["plan"].items() if t != history}
    pooled_rows = crossing_rows({"config": rx["config"], "plan": pooled})
    stats = rx["sharder_comm_stats_per_step"]
    # recxla: the pooled tables' e4m3 rows, and the sequence module's own count on top
    assert rx["wire_bytes_per_step_by_kind"]["embeddings_fwd"] == pytest.approx(
        pooled_rows * (dim + 4) + stats["sequence_embedding_bytes_sent"])
    torchrec_sequence = tr["wire_bytes_per_step_by_kind"]["embeddings_fwd"] - \
        pooled_rows * dim * 2
    assert 0 < stats["sequence_embedding_bytes_sent"] < 0.75 * torchrec_sequence, (
        stats, torchrec_sequence)
    assert stats["sequence_gradient_bytes_sent"] > 0


@pytest.mark.gpu
def test_trainer_on_one_gpu(tmp_path):
    """The whole trainer on a GPU (`make gpu-campaign`): NCCL, the CUDA kernels, the pipeline's
    streams with 2 micro-batches, the held-out evaluation and the metrics."""
    steps, warmup = 6, 2
    launch_ranks([*SMALL, "--device", "cuda", "--steps", str(steps), "--warmup-steps",
                  str(warmup), "--micro-batches", "2", "--metrics", str(tmp_path / "gpu.json")],
                 tmp_path, world_size=1)
    m = check_metrics(tmp_path / "gpu.json", 1, steps, warmup)
    assert m["path"] == "recxla" and m["device"].startswith("cuda")


def _parse_error(capsys, argv) -> str:
    from recxla.train.parse import parse_config

    with pytest.raises(SystemExit) as e:
        parse_config(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--batch-size", "0"], ["--fwd-comm", "int8"],
                                  ["--resume"], ["--data", "/nonexistent/x.parquet"]])
def test_an_error_before_training_is_one_line_from_each_nodes_first_rank(
        capsys, monkeypatch, argv):
    """Every rank finds the same error: the first rank of a node prints it, on one line with no
    usage text (argparse's is 40 lines), the others exit 2 too, quietly."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    err = _parse_error(capsys, argv)
    assert err.startswith("recxla-train: error: ") and err.count("\n") == 1, err
    assert "usage:" not in err
    if argv[0] == "--data":  # a file's error names the option and the file; no --help pointer
        assert "--help" not in err
    else:
        assert "`recxla-train --help` lists the options" in err
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert _parse_error(capsys, argv) == ""


@pytest.mark.parametrize("argv, message", [
    (["--batch-size", "0"], "--batch-size: must be an int >= 1, got 0"),
    (["--baseline", "torchrec", "--micro-batches", "2"],
     "--micro-batches applies to the recxla path only"),
    (["--baseline", "torchrec", "--trace", "t.json"], "--trace applies to the recxla path only"),
    (["--baseline", "torchrec", "--replica-sync", "weights"],
     "--replica-sync applies to the recxla path only"),
    (["--baseline", "torchrec", "--no-overlap"], "--overlap applies to the recxla path only"),
    (["--replica-sync", "weights", "--replica-precision", "bf16"],
     "--replica-precision bf16 applies to --replica-sync gradients"),
    (["--baseline", "torchrec", "--sharding", "row_wise"], "no row-wise sharding on CPU"),
    (["--baseline", "torchrec", "--fwd-comm", "e4m3"],
     "--fwd-comm applies to the recxla path only"),
    (["--baseline-comms", "bf16"], "--baseline-comms applies to --baseline torchrec only"),
    (["--baseline-plan", "same"], "--baseline-plan applies to --baseline torchrec only"),
    (["--baseline-pipeline", "sparse_dist_lite"],
     "--baseline-pipeline applies to --baseline torchrec only"),
    (["--baseline", "torchrec", "--baseline-pipeline", "semi_sync"], "invalid choice: 'semi_sync'"),
    (["--baseline", "torchrec", "--baseline-plan", "same", "--sharding", "table_wise"],
     "--baseline-plan applies to --sharding auto"),
    (["--data-parallel-tables", "--sharding", "table_wise"],
     "--data-parallel-tables applies to --sharding auto"),
    (["--early-rows", "--topology", "2d", "--ranks-per-node", "2"],
     "--early-rows with --topology 2d is not supported: the next batch would read rows"),
    (["--dbp-lookup", "early", "--topology", "2d", "--ranks-per-node", "2"],
     "--dbp-lookup early with --topology 2d is not supported"),
    (["--data-parallel-tables", "--topology", "2d", "--ranks-per-node", "2"],
     "--data-parallel-tables with --topology 2d is not supported"),
    (["--baseline", "torchrec", "--data-parallel-tables"],
     "--data-parallel-tables applies to the recxla path only"),
    (["--baseline", "torchrec", "--no-dense-allreduce-by-node"],
     "--dense-allreduce-by-node applies to the recxla path only"),
    (["--dense-floor"], "--dense-floor applies to --baseline torchrec only"),
    (["--powersgd-rank", "0", "--dense-allreduce", "powersgd"],
     "--powersgd-rank: must be an int >= 1, got 0"),
    (["--powersgd-start", "2"],
     "--powersgd-start applies to --dense-allreduce powersgd (the dense all-reduce is bf16)"),
    (["--eval-fraction", "0.2"], "--eval-fraction applies to --data"),
    (["--eval-fraction", "1"], "--eval-fraction: must be a number in (0, 1), got 1.0"),
    (["--overlap", "maybe"], "unrecognized arguments: maybe"),
    (["--fwd-comm", "int8"], "invalid choice: 'int8'"),
    (["--steps", "4", "--warmup-steps", "4"], "--warmup-steps 4 must be less than"),
    (["--resume"], "--resume and --checkpoint-every need --checkpoint-dir"),
    (["--timeout", "0"], "--timeout: must be a number > 0"),
    (["--ddp-bucket-mb", "0"], "--ddp-bucket-mb: must be a number > 0"),
    (["--ddp-bucket-merge", "on", "--dense-allreduce", "fp8"],
     "--ddp-bucket-merge applies to --dense-allreduce fp32 and bf16 (the fp8 wire sends its "
     "buckets its own way)"),
    (["--ddp-bucket-merge", "sometimes"], "invalid choice: 'sometimes'"),
    (["--baseline", "torchrec", "--ddp-bucket-merge", "on"],
     "--ddp-bucket-merge applies to the recxla path only"),
    (["--data", "/nonexistent/x.parquet"], "/nonexistent/x.parquet: no such file or folder"),
    (["--device", "cuda"], "no CUDA device"),
])
def test_bad_options(capsys, argv, message):
    if argv == ["--device", "cuda"]:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a CUDA device is visible")
    assert message in _parse_error(capsys, argv)


def test_resume_needs_a_checkpoint(capsys, tmp_path):
    err = _parse_error(capsys, ["--resume", "--checkpoint-dir", str(tmp_path)])
    assert "no checkpoint in --checkpoint-dir" in err


def test_bad_options_exit_before_any_process_group(tmp_path):
    # Rank 1 of a job whose rank 0 never comes (the first rank of a second node, which prints
    # the error): joining the group would wait for the timeout.
    env = dict(os.environ, RANK="1", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), PYTHONPATH=RANK_PYTHONPATH)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "recxla.train", "--baseline", "torchrec",
                           "--micro-batches", "4", "--timeout", "60"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--micro-batches applies to the recxla path only" in proc.stderr
    assert time.monotonic() - start < 30


def test_compare_rejects_a_file_that_is_not_metrics(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"examples_per_s": 1.0}))
    from recxla.train.compare import main

    assert main(["--compare", str(bad)]) == 2


def _metrics_file(path, name: str, examples_per_s: float) -> str:
    """A metrics file with what --compare reads (a run's summary has more)."""
    step = {"mean": 0.05, "compute": 0.03, "data": 0.01, "exposed_comm": 0.01,
            "comm_in_flight": 0.02}
    path.write_text(json.dumps({
        "name": name, "path": "recxla", "world_size": 2, "config": {"batch_size": 128},
        "examples_per_s": examples_per_s, "step_time_s": step, "exposed_comm_fraction": 0.2,
        "wire_bytes_per_step": 1e5, "final_loss": 0.5, "auc": 0.75}))
    return str(path)


def test_compare_writes_a_chart_only_when_asked(tmp_path, monkeypatch, capsys):
    """No compare.png in the current folder unless --chart names it; --chart PATH writes there
    and says so; a folder that does not exist is an error before anything is printed."""
    from recxla.train.compare import main

    a = _metrics_file(tmp_path / "a.json", "a", 1000.0)
    b = _metrics_file(tmp_path / "b.json", "b", 1500.0)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert main(["--compare", a, b]) == 0
    assert "1.50x" in capsys.readouterr().out
    assert list(work.iterdir()) == []
    assert main(["--compare", a, b, "--chart", ""]) == 0
    assert list(work.iterdir()) == []
    chart = tmp_path / "charts" / "c.png"
    assert main(["--compare", a, b, "--chart", str(chart)]) == 2
    assert "--chart" in capsys.readouterr().err
    chart.parent.mkdir()
    assert main(["--compare", a, b, "--chart", str(chart)]) == 0
    assert f"wrote {chart}" in capsys.readouterr().out
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(work.iterdir()) == []


def test_options_are_declared_once(capsys):
    """Every TrainConfig field is an option whose --help states its path and its one default,
    the parser's namespace holds only what was given, and a switch is --x/--no-x only (the
    older `--overlap off` is refused, naming the stray word)."""
    import dataclasses

    from recxla.train import options
    from recxla.train.config import TrainConfig
    from recxla.train.parse import build_parser, parse_config

    text = build_parser().format_help()
    fields = dataclasses.fields(TrainConfig)
    assert all("option" in f.metadata for f in fields)
    for field, meta in options.options_of(TrainConfig):
        assert options.flag_of(field) in text
    assert "--no-overlap" in text and "--no-dedup-ids" in text and "--no-progress" in text
    assert vars(build_parser().parse_args(["--steps", "3"])) == {"steps": 3}
    default = parse_config([])
    assert (default.overlap, default.dbp, default.resume, default.device) == (
        True, True, False, "cpu" if not __import__("torch").cuda.is_available() else "cuda")
    off = parse_config(["--no-overlap", "--no-dbp", "--no-dedup-ids"])
    assert (off.overlap, off.dbp, off.dedup_ids) == (False, False, False)
    assert parse_config(["--overlap"]).overlap is True
    assert "unrecognized arguments: off" in _parse_error(capsys, ["--overlap", "off"])
    assert "ignored explicit argument 'off'" in _parse_error(capsys, ["--dbp=off"])
    # The baseline ignores the recxla path's defaults; its sharder sends every id, as bags.
    baseline = parse_config(["--baseline", "torchrec"])
    assert (baseline.dedup_ids, baseline.row_exchange, baseline.comms) == (
        False, "off", ("fp32", "fp32"))
    from recxla.formats import DEFAULT_BWD_COMM

    assert default.bwd_comm == DEFAULT_BWD_COMM


def test_declaring_the_options_imports_neither_the_pipeline_nor_torchrec():
    """recxla.train.config takes its choices from modules that import nothing
    (recxla.pipeline.choices, recxla.torchrec.choices): declaring the options loads no
    pipeline and no TorchRec (recxla.torchrec's package loads its codec, which needs neither)."""
    code = ("import sys, recxla.train.config; print(sorted(m for m in sys.modules if "
            "m.startswith(('torchrec', 'fbgemm', 'recxla.pipeline.'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=RANK_PYTHONPATH), timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['recxla.pipeline.choices']"


def test_docs_options_reference_is_the_declaration():
    from recxla.train.parse import options_markdown

    with open(os.path.join(REPO, "docs", "training.md")) as f:
        text = f.read()
    begin, end = "<!-- options: begin -->\n", "<!-- options: end -->"
    documented = text[text.index(begin) + len(begin):text.index(end)]
    assert documented.strip() == options_markdown().strip(), (
        "docs/training.md's options are out of date: regenerate them with options_markdown()")


def test_dense_optimizer_runs_where_torch_has_its_kernel():
    """torch's fused Adagrad has no CUDA kernel (a GPU run stopped at its first dense step):
    there the trainer's dense Adagrad runs foreach; everything else fused, with the same update
    as torch's plain loop."""
    import torch

    from recxla.train.sharding import dense_optimizer_kwargs

    assert dense_optimizer_kwargs("adagrad", "cuda") == {"foreach": True}
    assert dense_optimizer_kwargs("sgd", "cuda") == {"fused": True}
    for name, make in (("adagrad", torch.optim.Adagrad), ("sgd", torch.optim.SGD)):
        for device_type in ("cpu", "cuda"):
            kwargs = dense_optimizer_kwargs(name, device_type)
            fast, plain = [torch.nn.Parameter(torch.randn(7, 5)) for _ in range(2)]
            plain.data.copy_(fast.data)
            grad = torch.randn(7, 5)
            steps = [make([fast], lr=0.1, **kwargs), make([plain], lr=0.1, foreach=False)]
            for p, opt in zip((fast, plain), steps):
                p.grad = grad.clone()
                opt.step()
            torch.testing.assert_close(fast, plain)


def test_checkpoint_dir_may_name_folders_not_made_yet(tmp_path):
    """--checkpoint-dir is made with its parents when the first checkpoint is written (a file
    option still needs its folder)."""
    from recxla.train.parse import parse_config

    nested = tmp_path / "runs" / "today" / "ck"
    assert parse_config(["--checkpoint-dir", str(nested)]).checkpoint_dir == str(nested)
    with pytest.raises(SystemExit):
        parse_config(["--metrics", str(tmp_path / "missing" / "m.json")])
