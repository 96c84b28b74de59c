"""The baseline a TorchRec user runs. The trainer's plans (recxla.train.sharding.plan_sharding):
the TorchRec baseline plans as a TorchRec user's run does, free to make tables data-parallel;
--baseline-plan same and the recxla path keep every table model-parallel, unless
--data-parallel-tables, where the recxla path plans as TorchRec's own run does. The cluster
benchmark's headline ratios are against the fastest TorchRec variant of the run.

The planner runs on one gloo rank for a topology of 2 nodes x 2 ranks at the trainer's default
model (the Criteo profile): there TorchRec's own planner replicates the small tables at fp32.
"""

import os
import sys

import pytest
from distributed_utils import run_distributed

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # bench/ is a folder of the repository, not of the package
    sys.path.insert(0, _ROOT)

WORLD, PER_NODE = 4, 2


def _plans(rank, world, variants):
    import torch

    from recxla.train.parse import parse_config
    from recxla.train.data import TrainData
    from recxla.train.models import build_model
    from recxla.train.sharding import plan_sharding, plan_summary

    out = {}
    for name, argv in variants.items():
        config = parse_config([*argv, "--sparse-optimizer", "sgd", "--device", "cpu"])
        data = TrainData(config, 0, WORLD)
        tables = data.tables()
        model = build_model(config, tables, data.num_dense, torch.device("meta"), data.weighted)
        plan = plan_sharding(model, config, tables, WORLD, PER_NODE, torch.device("cpu"))
        out[name] = {t: p["sharding"] for t, p in plan_summary(plan).items()}
        out[name + " names"] = sorted(t.name for t in tables)
    return out


def test_baseline_plans_as_torchrec_and_same_keeps_recxla_plan():
    variants = {"torchrec": ["--baseline", "torchrec"],
                "same": ["--baseline", "torchrec", "--baseline-plan", "same"],
                "recxla": [], "recxla own": ["--data-parallel-tables"]}
    plans = run_distributed(_plans, 1, args=(variants,))[0]
    for name in variants:
        assert sorted(plans[name]) == plans[name + " names"]  # every table planned
    own = plans["torchrec"]
    replicated = [t for t, s in own.items() if s == "data_parallel"]
    assert replicated and len(replicated) < len(own)
    assert plans["same"] == plans["recxla"]
    assert "data_parallel" not in plans["recxla"].values()
    # recxla's sharder hands data-parallel tables to TorchRec's: the planner decides alike.
    assert plans["recxla own"] == own


def _bench_run(eps: float, cpu_us: float) -> dict:
    return {"examples_per_s": eps, "auc": 0.7, "exposed_comm_fraction": 0.1,
            "step_time_s": {"mean": 0.2, "compute": 0.1, "comm_in_flight": 0.05, "data": 0.0,
                            "exposed_comm": 0.02},
            "wire_bytes_per_step": 1e6, "cross_node_bytes_per_step": 5e5,
            "wire_bytes_per_step_by_kind": {}, "cpu_us_per_example": {"mean": cpu_us}}


def test_cluster_table_ratios_are_against_the_fastest_torchrec_variant():
    from bench.cluster.run_train import fastest_torchrec, table

    rows = {"torchrec fp32": [_bench_run(1000, 50)],
            "torchrec bf16+AR": [_bench_run(1500, 50), _bench_run(2500, 50),
                                 _bench_run(2000, 50)],  # median 2000
            "recxla DBP": [_bench_run(3000, 40)]}
    assert fastest_torchrec(rows) == "torchrec bf16+AR"
    assert fastest_torchrec({"recxla DBP": rows["recxla DBP"]}) is None
    lines = {line.split("  ")[0].strip(): line.split() for line in table(
        "1gbit", "netns", rows).splitlines()[3:]}
    # ex/s, vs best TR, vs TR fp32, step ms, compute, CPU us/ex
    assert lines["recxla DBP"][2:8] == ["3,000", "1.50x", "3.00x", "200", "100", "40.0"]
    assert lines["torchrec fp32"][2:5] == ["1,000", "0.50x", "1.00x"]


def test_cluster_variants_parse(capsys, monkeypatch):
    from bench.cluster.run_train import VARIANTS, main

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # --list sets it as the launcher does

    assert "torchrec bf16+AR" in VARIANTS
    assert main(["--list"]) == 0
    listed = capsys.readouterr().out
    assert all(label in listed for label in VARIANTS)
    with pytest.raises(SystemExit):
        main(["--list", "--variants", "torchrec fp64"])


def test_powersgd_variants_compress_from_the_first_measured_step():
    from types import SimpleNamespace

    from bench.cluster.run_train import VARIANTS, powersgd_steady_state

    args = SimpleNamespace(warmup=7, train_args=[])
    for label in ("torchrec bf16+PowerSGD", "recxla DBP powersgd AR"):
        assert powersgd_steady_state(VARIANTS[label], args) == ["--powersgd-start", "7"]
    assert powersgd_steady_state(VARIANTS["recxla DBP fp8 AR"], args) == []
    given = SimpleNamespace(warmup=7, train_args=["--powersgd-start", "2"])  # the user's wins
    assert powersgd_steady_state(VARIANTS["recxla DBP powersgd AR"], given) == []


def test_compare_ratio_to_the_fastest_torchrec_run():
    from recxla.train.compare import rows

    def run(name, path, eps):
        return {"name": name, "path": path, "world_size": 2, "config": {"batch_size": 8},
                **_bench_run(eps, 10.0), "final_loss": 0.5, "eval_loss": 0.5}

    table = {row[0]: row[1:] for row in rows([run("tr fp32", "torchrec", 1000),
                                              run("tr bf16", "torchrec", 1600),
                                              run("recxla", "recxla", 2400)])}
    assert table["  vs fastest torchrec (tr bf16)"] == ["0.62x", "1.00x", "1.50x"]
    assert table["CPU us/example"] == ["10.0"] * 3
