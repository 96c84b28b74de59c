"""recxla-train with recxla's overlap pipeline: micro-batches, a Chrome trace of every rank, and
the 2D topology, end to end on gloo ranks."""

import json

import pytest

from test_train_cli import SMALL, check_metrics, launch_ranks

pytestmark = pytest.mark.distributed


def test_pipeline_trains_and_writes_a_trace(tmp_path):
    steps, warmup = 6, 2
    trace = tmp_path / "trace.json"
    launch_ranks([*SMALL, "--steps", str(steps), "--warmup-steps", str(warmup),
                  "--micro-batches", "3", "--split", "clustered", "--dense-allreduce", "bf16",
                  "--trace", str(trace), "--metrics", str(tmp_path / "m.json")], tmp_path)
    m = check_metrics(tmp_path / "m.json", 2, steps, warmup)
    assert "3 micro-batches, overlap on, dbp on" in m["pipeline"]
    # The trainer keeps TorchRec's gradient division off on both paths, and says so.
    assert m["gradient_division"].startswith("embedding gradients summed over ranks")
    # bf16 dense all-reduce: half the bytes of fp32 (same parameters on every path)
    assert m["wire_bytes_per_step_by_kind"]["dense_allreduce"] > 0
    events = json.loads(trace.read_text())["traceEvents"]
    for rank in (0, 1):
        spans = [e for e in events if e.get("pid") == rank and e.get("ph") == "X"]
        names = {e["name"] for e in spans}
        assert {"lookup", "dense", "update", "wait embeddings"} <= names, names
        assert any(n.startswith("all_to_all_single") for n in names), names
        dense = [e for e in spans if e["name"] == "dense"]
        assert len(dense) == 3 * steps  # one per micro-batch
        assert all(e["dur"] >= 0 for e in spans)


def test_2d_topology_trains(tmp_path):
    """4 ranks as 2 nodes of 2: the all-to-alls inside a node, gradients summed across."""
    steps, warmup = 4, 1
    launch_ranks([*SMALL, "--steps", str(steps), "--warmup-steps", str(warmup),
                  "--topology", "2d", "--ranks-per-node", "2", "--micro-batches", "2",
                  "--metrics", str(tmp_path / "m.json")], tmp_path, world_size=4, timeout=240)
    m = check_metrics(tmp_path / "m.json", 4, steps, warmup)
    assert m["topology"] == "2d"
    assert m["dense_allreduce_layout"] == "by node"
    assert "row exchange for" in m["sharder"], m["sharder"]  # --row-exchange auto, in 2D too


def test_dense_allreduce_by_node_trains_as_the_ring(tmp_path):
    """4 ranks as 2 nodes of 2 (1D): the dense all-reduce by node (the default there) trains as
    the ring does, up to float rounding, with a third fewer dense bytes across the nodes."""
    steps, warmup = 4, 1
    runs = {}
    for layout, flag in (("by node", "--dense-allreduce-by-node"),
                         ("ring", "--no-dense-allreduce-by-node")):
        path = tmp_path / f"{flag}.json"
        launch_ranks([*SMALL, "--steps", str(steps), "--warmup-steps", str(warmup), flag,
                      "--metrics", str(path)], tmp_path, world_size=4, timeout=240,
                     ranks_per_node=2)
        runs[layout] = check_metrics(path, 4, steps, warmup)
        assert runs[layout]["dense_allreduce_layout"] == layout
    assert runs["by node"]["final_loss"] == pytest.approx(runs["ring"]["final_loss"], rel=1e-4)
    assert runs["by node"]["auc"] == pytest.approx(runs["ring"]["auc"], abs=1e-3)
    # Per rank, the ring sends 2 (W-1)/W = 1.5x the gradients to the next rank (one rank in
    # two crosses nodes); by node, 0.5x across and 0.5x + 0.5x inside: the same total, and the
    # cross-node part drops from 1.5x to 1.0x per node.
    ring, by_node = runs["ring"], runs["by node"]
    assert by_node["cross_node_bytes_per_step"] < ring["cross_node_bytes_per_step"]
    # The buckets sent together (one sum a step) train bit for bit as the default's.
    path = tmp_path / "together.json"
    launch_ranks([*SMALL, "--steps", str(steps), "--warmup-steps", str(warmup),
                  "--ddp-bucket-merge", "on", "--metrics", str(path)], tmp_path, world_size=4,
                 timeout=240, ranks_per_node=2)
    together = check_metrics(path, 4, steps, warmup)
    assert together["dense_buckets_together"] == [steps, steps]
    assert by_node["dense_buckets_together"][1] == steps
    assert (together["final_loss"], together["auc"]) == (by_node["final_loss"], by_node["auc"])


def test_data_parallel_tables_train_on_the_recxla_path(tmp_path):
    """--data-parallel-tables: TorchRec's own plan on the recxla path, its replicated tables
    TorchRec's, trained by the dense optimizer beside recxla's sharded ones."""
    steps, warmup = 4, 1
    # The Criteo profile's small tables are the ones TorchRec's planner replicates.
    criteo = [a for a in SMALL if a not in ("--profile", "small")]
    # 2 nodes x 2 ranks: across nodes, replicating them is cheaper than sending their rows.
    launch_ranks([*criteo, "--max-rows", "20000", "--steps", str(steps), "--warmup-steps",
                  str(warmup), "--data-parallel-tables", "--metrics", str(tmp_path / "m.json")],
                 tmp_path, world_size=4, timeout=240, ranks_per_node=2)
    m = check_metrics(tmp_path / "m.json", 4, steps, warmup)
    kinds = [t["sharding"] for t in m["plan"].values()]
    assert "data_parallel" in kinds and any(k != "data_parallel" for k in kinds), kinds
    assert "TorchRec's own plan" in m["sharder"]
