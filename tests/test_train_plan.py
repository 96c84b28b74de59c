"""The trainer's plans (recxla.train.sharding.plan_sharding): the TorchRec baseline plans as a
TorchRec user's run does, free to make tables data-parallel; --baseline-plan same and the recxla
path keep every table model-parallel.

The planner runs on one gloo rank for a topology of 2 nodes x 2 ranks at the trainer's default
model (the Criteo profile): there TorchRec's own planner replicates the small tables at fp32.
"""

from distributed_utils import run_distributed

WORLD, PER_NODE = 4, 2


def _plans(rank, world, variants):
    import torch

    from recxla.train.config import parse_config
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
                "recxla": []}
    plans = run_distributed(_plans, 1, args=(variants,))[0]
    for name in variants:
        assert sorted(plans[name]) == plans[name + " names"]  # every table planned
    own = plans["torchrec"]
    replicated = [t for t, s in own.items() if s == "data_parallel"]
    assert replicated and len(replicated) < len(own)
    assert plans["same"] == plans["recxla"]
    assert "data_parallel" not in plans["recxla"].values()
