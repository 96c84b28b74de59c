"""recxla.sim: the step model's invariants, its workload measurement, and the CLI."""

import json
import random
from dataclasses import replace

import pytest
import torch

from recxla.data import SyntheticRankingDataset, criteo_kaggle_profile
from recxla.sim import (
    A100_P4D,
    H100_IB,
    StepConfig,
    Workload,
    dlrm_dense_flops,
    emulated,
    preset,
    scaling,
    step,
)
from recxla.sim.__main__ import main

FORMATS = ["fp32", "bf16", "e4m3", "e5m2"]


def random_workload() -> Workload:
    ids = random.uniform(1, 200)
    return Workload(
        name="random",
        dims=tuple(random.choice([8, 16, 64, 128]) for _ in range(random.randint(1, 30))),
        ids_per_example=ids,
        unique_per_example=random.uniform(0, ids),
        dense_flops_per_example=10 ** random.uniform(3, 9),
        dense_param_bytes=10 ** random.uniform(4, 9),
        table_bytes=10 ** random.uniform(6, 11),
    )


def random_config(**fixed) -> StepConfig:
    config = dict(
        topology=random.choice(["1d", "2d"]), fwd_comm=random.choice(FORMATS),
        bwd_comm=random.choice(FORMATS), overlap=random.random() < 0.5,
        micro_batches=random.randint(1, 8), sync=random.choice(["grads", "weights"]),
        sync_every=random.randint(1, 100), imbalance=random.uniform(1.0, 2.0),
    )
    config.update(fixed)
    return StepConfig(**config)


def random_case():
    hw = random.choice([H100_IB, A100_P4D, emulated(random.choice([0.2, 1.0]), 2)])
    hw = replace(hw, fixed_step_s=random.choice([0.0, 1e-3]))
    return random_workload(), hw, random.randint(1, 64), random.randint(1, 8192)


def test_more_bandwidth_is_never_slower():
    for _ in range(200):
        work, hw, nodes, batch = random_case()
        config = random_config()
        base = step(work, hw, nodes, batch, config).step
        for field in ("intra_bytes_per_s", "inter_bytes_per_s", "memory_bytes_per_s",
                      "codec_bytes_per_s", "peak_flops"):
            faster = step(work, hw.scaled(**{field: random.uniform(1.0, 10.0)}), nodes, batch,
                          config).step
            assert faster <= base * (1 + 1e-12), field


def test_overlap_is_never_slower_than_no_overlap():
    for _ in range(200):
        work, hw, nodes, batch = random_case()
        on = random_config(overlap=True)
        off = replace(on, overlap=False)
        assert step(work, hw, nodes, batch, on).step <= step(work, hw, nodes, batch, off).step


def test_one_node_has_no_inter_node_term():
    for _ in range(100):
        work, hw, _, batch = random_case()
        config = random_config()
        one = step(work, hw, 1, batch, config)
        assert one.inter_node_bytes == 0.0 and one.sync_2d == 0.0
        # The network's rate and latency do not matter on one node.
        other = replace(hw, inter_bytes_per_s=hw.inter_bytes_per_s * 1e-3,
                        inter_latency_s=hw.inter_latency_s + 1.0)
        assert step(work, other, 1, batch, config) == one
        # 1D and 2D are the same thing on one node.
        assert step(work, hw, 1, batch, replace(config, topology="2d")).step == pytest.approx(
            step(work, hw, 1, batch, replace(config, topology="1d")).step)
    two = step(random_workload(), H100_IB, 2, 1024, StepConfig("1d"))
    assert two.inter_node_bytes > 0


def test_units():
    """Every rate times c and every latency divided by c divides every time by c; examples/s
    is ranks x batch / step."""
    for _ in range(100):
        work, hw, nodes, batch = random_case()
        config = random_config()
        c = random.uniform(0.1, 10.0)
        fast = replace(
            hw.scaled(intra_bytes_per_s=c, inter_bytes_per_s=c, peak_flops=c,
                      memory_bytes_per_s=c, codec_bytes_per_s=c),
            intra_latency_s=hw.intra_latency_s / c, inter_latency_s=hw.inter_latency_s / c,
            fixed_step_s=hw.fixed_step_s / c)
        slow, quick = step(work, hw, nodes, batch, config), step(work, fast, nodes, batch, config)
        for name, value in slow.as_dict().items():
            if name == "examples_per_s":
                assert quick.examples_per_s == pytest.approx(value * c, rel=1e-9)
            elif name not in ("inter_node_bytes", "wire_bytes"):
                assert getattr(quick, name, quick.as_dict()[name]) == pytest.approx(
                    value / c, rel=1e-9, abs=1e-18), name
        assert slow.examples_per_s == pytest.approx(nodes * hw.gpus_per_node * batch / slow.step)


def test_fewer_bytes_and_better_balance_are_faster():
    for _ in range(100):
        work, hw, nodes, batch = random_case()
        nodes = max(nodes, 2)
        base = random_config(fwd_comm="fp32", bwd_comm="fp32", overlap=False)
        fp8 = replace(base, fwd_comm="e4m3", bwd_comm="e5m2")
        b32, b8 = step(work, hw, nodes, batch, base), step(work, hw, nodes, batch, fp8)
        assert b8.output_a2a <= b32.output_a2a and b8.grad_a2a <= b32.grad_a2a
        worse = replace(base, imbalance=base.imbalance * 1.5)
        assert step(work, hw, nodes, batch, worse).step >= b32.step


def test_scaling_is_relative_to_one_node():
    work = random_workload()
    points = scaling(work, H100_IB, [1, 2, 4], 1024, StepConfig("1d"))
    assert points[0].speedup == pytest.approx(1.0) and points[0].efficiency == pytest.approx(1.0)
    for p in points:
        assert p.efficiency == pytest.approx(p.speedup / p.nodes)


def test_dlrm_dense_flops_by_hand():
    # bottom 3 -> 4 -> 2, interaction of 2 sparse + 1 dense vectors (3 pairs) of dim 2,
    # top (2 + 3) -> 1.
    flops, params = dlrm_dense_flops(3, 2, 2, dense_arch=(4,), over_arch=(1,))
    assert params == (3 * 4 + 4 * 2) + (5 * 1) + (4 + 2 + 1)
    assert flops == 2 * (3 * 4 + 4 * 2 + 5 * 1) + 2 * 3 * 2


def test_workload_measure_counts_real_batches():
    profile = criteo_kaggle_profile(max_rows=500)
    work = Workload.measure(profile, dim=16, batch_size=128, sample_batches=2, seed=3)
    data = SyntheticRankingDataset(profile, batch_size=128, seed=3)
    batches = [data.batch(i).sparse for i in range(2)]
    ids = sum(b.values().numel() for b in batches) / 256
    unique = sum(torch.unique(b[k].values()).numel() for b in batches for k in b.keys()) / 256
    assert work.ids_per_example == pytest.approx(ids)
    assert work.unique_per_example == pytest.approx(unique)
    assert work.dims == (16,) * 26
    assert work.table_bytes == sum(f.num_embeddings for f in profile.features) * 16 * 4


def test_old_comm_keywords_still_work():
    """docs/sim.md documented StepConfig(fwd_fmt=..., bwd_fmt=...) before the pair took the
    sharder's names."""
    with pytest.warns(DeprecationWarning, match="fwd_fmt is now called fwd_comm"):
        old = StepConfig(fwd_fmt="fp32", bwd_fmt="bf16")
    assert old == StepConfig(fwd_comm="fp32", bwd_comm="bf16")


def test_bad_arguments():
    with pytest.raises(ValueError, match="topology must be one of"):
        StepConfig(topology="3d")
    with pytest.raises(ValueError, match="fwd_comm must be one of"):
        StepConfig(fwd_comm="int8")
    with pytest.raises(TypeError, match="got both bwd_comm and bwd_fmt"):
        StepConfig(bwd_comm="bf16", bwd_fmt="bf16")
    with pytest.raises(ValueError, match="imbalance is max/mean, so >= 1.0"):
        StepConfig(imbalance=0.5)
    with pytest.raises(ValueError, match="nodes must be an int >= 1"):
        step(random_workload(), H100_IB, 0, 16)
    with pytest.raises(ValueError, match="unknown hardware 'tpu'"):
        preset("tpu")
    with pytest.raises(ValueError, match="unique_per_example must be <= ids_per_example"):
        replace(random_workload(), ids_per_example=1.0, unique_per_example=2.0)
    assert preset("emulated-0.2gbit-2rpn") == emulated(0.2, 2)


def test_cli_prints_a_table_and_writes_the_plot(tmp_path, capsys):
    png = tmp_path / "scaling.png"
    runs = tmp_path / "runs.json"
    runs.write_text(json.dumps([{
        "nodes": 2, "ranks_per_node": 2, "link_gbit": 0.2, "batch_size": 128,
        "embedding_dim": 16, "topology": "1d", "fwd_comm": "fp32", "bwd_comm": "fp32",
        "overlap": False, "examples_per_s": 5000.0, "max_rows": 500,
    }]))
    code = main(["--nodes", "1,2,4", "--batch", "128", "--dim", "16", "--max-rows", "500",
                 "--hardware", "emulated-1gbit-2rpn", "--plot", str(png), "--check", str(runs)])
    out = capsys.readouterr().out
    assert code == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| 2d e4m3/bf16, overlap | 4 |" in out
    assert "measured runs against the model" in out and "2x2" in out
    assert main(["--nodes", "0"]) == 2


def test_cli_bad_input_is_one_line_and_status_2(tmp_path, capsys):
    bad_run = tmp_path / "bad.json"
    bad_run.write_text(json.dumps([{"nodes": 2}]))
    not_json = tmp_path / "not.json"
    not_json.write_text("{")
    common = ["--nodes", "1", "--batch", "128", "--dim", "16", "--max-rows", "500", "--plot", ""]
    for argv, message in (
            (["--check", str(bad_run)], "run 0 lacks"),
            (["--check", str(not_json)], "Expecting property name"),
            (["--check", str(tmp_path / "missing.json")], "No such file"),
            (["--hardware", "tpu"], "unknown hardware 'tpu'")):
        assert main(common + argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err
        assert err.count("recxla.sim:") == 1, err  # the prefix once
