"""The run's figures: throughput, the step's time split, bytes on the wire, loss and AUC.

Every rank measures its own steps (recxla.train.loop) and communication (CommMeter); rank 0
gathers them and builds the summary that is printed and written as JSON (--metrics):

- examples_per_s: global examples per second over the steps after warm-up (each step lasts as
  long as its slowest rank), and examples_per_s_p50 from the median step;
- step_time_s: mean per step, split into data (making the batch), compute, and exposed
  communication (the caller blocked on a collective); comm_s is the time collectives were in
  flight, hidden or not, and exposed_comm_fraction = exposed / step time;
- cpu_s_per_step: each rank's process CPU time (user + system, all its threads: gloo's and the
  compute pool's included) per step, p50 and mean, as the mean over ranks and the largest
  rank's; cpu_us_per_example: the job's CPU time per global example (the ranks' mean CPU per
  step / samples per rank), mean and largest rank's; cpu_cores_per_rank: CPU seconds per
  second of step (cores a rank kept busy). Where ranks share cores, a rank's wall time
  includes waiting for the cores; its CPU time does not;
- wire_bytes_per_step: bytes all ranks together send to other ranks per step (a rank's own
  split never leaves it), by what they carry: ids (input dist), embeddings forward, embedding
  gradients backward, dense all-reduce; cross_node_bytes_per_step: the part between nodes;
- final_loss: mean training loss over the last steps, over all ranks; auc and eval_loss (log
  loss, mean BCE) on the held-out data (torchmetrics' exact BinaryAUROC, synced over the
  ranks), eval_data saying which (TrainData.held_out_description).
"""

import json
import math
import os
import platform
import statistics
from typing import TYPE_CHECKING, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from recxla.train.config import TrainConfig

if TYPE_CHECKING:  # --compare reads metrics files without loading TorchRec
    from recxla.train.comm_meter import CommMeter
    from recxla.train.loop import StepLog

LAST_LOSS_STEPS = 20
# What every metrics file holds (scripts and --compare rely on them).
REQUIRED_KEYS = ("examples_per_s", "exposed_comm_fraction", "wire_bytes_per_step", "final_loss",
                 "auc")
# CommMeter "<phase>/<kind>" -> summary key; anything else is "other".
BYTE_KEYS = {
    "input/ids": "ids",
    "forward/ids": "ids",
    "forward/embeddings": "embeddings_fwd",
    "backward/embeddings": "embeddings_bwd",
    "backward/dense": "dense_allreduce",
}


@torch.no_grad()
def evaluate(model, batches, device: torch.device,
             on_batch: Optional[Callable[[int], None]] = None) -> Dict[str, float]:
    """AUC and BCE loss of `model` (DLRMTrain, sharded) over this rank's held-out `batches`,
    combined over all ranks. Returns {"auc", "eval_loss", "eval_examples"}. `on_batch(i)`
    after each batch: the trainer's watchdog hears that an evaluation longer than --timeout
    is moving, not deadlocked."""
    from torchmetrics.classification import BinaryAUROC

    auroc = BinaryAUROC().to(device)
    # [summed BCE, examples], on the model's device: no host read per batch (the whole held-out
    # split may be many batches), and NCCL, the process group on GPUs, reduces no host tensor.
    loss_sum = torch.zeros(2, dtype=torch.float64, device=device)
    model.eval()
    try:
        for i, batch in enumerate(batches):
            batch = batch.to(device)
            _, (_, logits, labels) = model(batch)
            auroc.update(logits.float(), labels.long())
            loss_sum[0] += torch.nn.functional.binary_cross_entropy_with_logits(
                logits.float(), labels.float(), reduction="sum").double()
            loss_sum[1] += labels.numel()
            if on_batch is not None:
                on_batch(i)
        auc = float(auroc.compute())  # gathers every rank's predictions
    finally:
        model.train()
    dist.all_reduce(loss_sum)
    return {"auc": auc, "eval_loss": float(loss_sum[0] / loss_sum[1]),
            "eval_examples": int(loss_sum[1])}


def iface_bytes(name: str) -> Dict[str, int]:
    """{"tx": bytes, "rx": bytes} the network interface `name` has counted (this network
    namespace's view of /sys/class/net)."""
    from recxla.train.config import NET_SYSFS

    out = {}
    for key in ("tx", "rx"):
        with open(os.path.join(NET_SYSFS, name, "statistics", f"{key}_bytes")) as f:
            out[key] = int(f.read())
    return out


def local_figures(log: "StepLog", meter: "CommMeter", warmup: int) -> dict:
    """This rank's measured steps (after warm-up) as plain lists, to gather on rank 0."""
    steps = list(range(log.first + warmup, log.first + len(log.seconds)))
    comm = [meter.step_comm(s) for s in steps]
    keep = slice(warmup, None)
    return {
        "seconds": log.seconds[keep], "cpu_s": log.cpu_s[keep], "data_s": log.data_s[keep],
        "faults": log.faults[keep],
        "loss": log.loss[-LAST_LOSS_STEPS:],
        "exposed_s": [c.exposed_s for c in comm], "comm_s": [c.comm_s for c in comm],
        "exposed_fwd_s": [sum(v for k, v in c.exposed_by_phase.items() if k != "backward")
                          for c in comm],
        "bytes": [c.bytes_sent for c in comm],
        "cross_node": [c.cross_node_bytes_sent for c in comm],
        "checkpoint_s": log.checkpoint_s,
    }


def _mean(xs) -> float:
    return statistics.fmean(xs) if xs else 0.0


def summarize(config: TrainConfig, ranks: List[dict], world_size: int) -> dict:
    """The summary from every rank's `local_figures` (rank order)."""
    n = min(len(r["seconds"]) for r in ranks)
    step_s = [max(r["seconds"][i] for r in ranks) for i in range(n)]
    examples = config.batch_size * world_size
    per_rank = lambda key: _mean([_mean(r[key][:n]) for r in ranks])  # noqa: E731
    mean_step = per_rank("seconds")
    exposed, data = per_rank("exposed_s"), per_rank("data_s")
    wire: Dict[str, float] = {}
    for r in ranks:
        for step_bytes in r["bytes"][:n]:
            for key, b in step_bytes.items():
                name = BYTE_KEYS.get(key, "other")
                wire[name] = wire.get(name, 0.0) + b / n
    faults = [f for r in ranks for f in r["faults"][:n]]
    # The link's own count: one reader per node (its local rank 0), over the measured steps.
    links = [r["iface"] for r in ranks if r.get("iface")]
    losses = [x for r in ranks for x in r["loss"]]
    cpu_p50 = [statistics.median(r["cpu_s"][:n]) if n else 0.0 for r in ranks]
    cpu_mean = [_mean(r["cpu_s"][:n]) for r in ranks]
    per_example = [c / config.batch_size * 1e6 for c in cpu_mean]
    return {
        "examples_per_s": examples * n / sum(step_s) if n else 0.0,
        "examples_per_s_p50": examples / statistics.median(step_s) if n else 0.0,
        "measured_steps": n,
        "step_time_s": {
            "mean": _mean(step_s), "p50": statistics.median(step_s) if n else 0.0,
            "rank_mean": mean_step, "data": data,
            "compute": mean_step - data - exposed, "exposed_comm": exposed,
            "exposed_comm_forward": per_rank("exposed_fwd_s"), "comm_in_flight": per_rank("comm_s"),
        },
        "exposed_comm_fraction": exposed / mean_step if mean_step else 0.0,
        "cpu_s_per_step": {"p50": _mean(cpu_p50), "p50_max_rank": max(cpu_p50),
                           "mean": _mean(cpu_mean), "mean_max_rank": max(cpu_mean)},
        "cpu_us_per_example": {"mean": _mean(per_example), "max_rank": max(per_example)},
        "cpu_cores_per_rank": _mean(cpu_mean) / mean_step if mean_step else 0.0,
        "wire_bytes_per_step": sum(wire.values()),
        "wire_bytes_per_step_by_kind": {k: wire[k] for k in sorted(wire)},
        "cross_node_bytes_per_step": sum(_mean(r["cross_node"][:n]) for r in ranks),
        "iface_tx_bytes_per_step": sum(x["tx"] for x in links) / n if links and n else None,
        "final_loss": _mean(losses),
        "page_faults_per_step": {
            "p50": statistics.median(faults) if faults else 0, "max": max(faults, default=0),
            "mean": _mean(faults)},
        "checkpoint_s": max(r["checkpoint_s"] for r in ranks),
    }


def machine() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "loadavg_1m": os.getloadavg()[0],
            "torch": torch.__version__, "python": platform.python_version()}


def _si(x: float, unit: str) -> str:
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.0f} {unit}"


def _dims_option(value) -> str:
    """--embedding-dims as it was given, from the config's ("auto", keep) or pairs."""
    if value and value[0] == "auto":
        return "auto" if value[1] == 0.5 else f"auto:{value[1]}"
    return ",".join(f"{n}={d}" for n, d in value)


def format_summary(s: dict) -> str:
    """The end-of-run summary, as printed by rank 0."""
    t, cpu = s["step_time_s"], s["cpu_s_per_step"]
    # The loader's worker processes (or Ray tasks) keep their CPU out of the ranks' rusage.
    workers = s["config"].get("loader_workers") or 0
    ms = lambda x: f"{x * 1e3:.1f} ms"  # noqa: E731
    pct = lambda x: f"{100 * x / t['rank_mean']:.0f}%" if t["rank_mean"] else "-"  # noqa: E731
    lines = [
        f"{s['name']}: {s['world_size']} ranks x {s['config']['batch_size']} samples, "
        f"{s['config']['model']}, {s['sharder']}",
        f"  examples/s      {s['examples_per_s']:,.0f} mean, {s['examples_per_s_p50']:,.0f} p50 "
        f"({s['measured_steps']} steps after {s['config']['warmup_steps']} warm-up)",
        f"  step time       {ms(t['mean'])} mean, {ms(t['p50'])} p50 (slowest rank)",
        f"    compute       {ms(t['compute'])} ({pct(t['compute'])})",
        f"    data          {ms(t['data'])} ({pct(t['data'])})",
        f"    exposed comm  {ms(t['exposed_comm'])} ({pct(t['exposed_comm'])}; forward "
        f"{ms(t['exposed_comm_forward'])})",
        f"    comm in flight {ms(t['comm_in_flight'])} (hidden or not)",
        f"  CPU time/step   {ms(cpu['p50'])} p50 ({ms(cpu['p50_max_rank'])} busiest rank), "
        f"{s['cpu_cores_per_rank']:.2f} cores per rank busy",
        f"  CPU/example     {s['cpu_us_per_example']['mean']:.1f} us "
        f"({s['cpu_us_per_example']['max_rank']:.1f} us busiest rank; all threads"
        + (f"; not the loader's {workers} worker process(es) per rank)" if workers else ")"),
        f"  wire bytes/step {_si(s['wire_bytes_per_step'], 'B')} (all ranks; "
        + ", ".join(f"{k} {_si(v, 'B')}" for k, v in s["wire_bytes_per_step_by_kind"].items())
        + ")",
    ]
    dims = s.get("embedding_dims") or {}
    if len(set(dims.values())) > 1:
        by_dim: dict = {}
        for name, d in dims.items():
            by_dim[d] = by_dim.get(d, 0) + 1
        lines.append("  embedding dims  " + ", ".join(
            f"{n} table{'s' if n > 1 else ''} at {d}" for d, n in sorted(by_dim.items(),
                                                                      reverse=True))
            + (f" (--embedding-dims {_dims_option(s['config']['embedding_dims'])})"))
    stats = s.get("sharder_comm_stats_per_step") or {}
    if "sequence_embedding_bytes_sent" in stats:
        lines.append(
            f"    sequence    {_si(stats['sequence_id_bytes_sent'], 'B')} ids, "
            f"{_si(stats['sequence_embedding_bytes_sent'], 'B')} rows, "
            f"{_si(stats['sequence_gradient_bytes_sent'], 'B')} gradients (the history's "
            "EmbeddingCollection, counted by recxla's module)")
    early, late = stats.get("rows_sent_early", 0), stats.get("rows_sent_late", 0)
    if early + late:
        lines.append(f"  early rows      {early / (early + late):.0%} of the embedding rows "
                     "(pooled bags, row-exchange rows) left before the update (--early-rows)")
    if s.get("cross_node_bytes_per_step") and s["nodes"] > 1:
        lines.append(f"    across nodes  {_si(s['cross_node_bytes_per_step'], 'B')}")
    if s.get("iface_tx_bytes_per_step") is not None:
        lines.append(f"    sent on {s['config']['net_iface']}  "
                     f"{_si(s['iface_tx_bytes_per_step'], 'B')} (the interface's counters)")
    together, steps = s.get("dense_buckets_together") or (0, 0)
    if steps and s["config"].get("ddp_bucket_merge", "off") != "off":
        lines.append(f"  dense buckets   together in {together} of {steps} steps "
                     f"(--ddp-bucket-merge {s['config']['ddp_bucket_merge']})")
    lines += [
        f"  loss            {s['final_loss']:.4f} (train, last steps)",
        f"  held-out        AUC {s['auc']:.4f}, log loss {s['eval_loss']:.4f} "
        f"({s['eval_examples']:,} examples: {s.get('eval_data', 'held-out split')})",
        f"  page faults     {s['page_faults_per_step']['p50']:.0f} p50, "
        f"{s['page_faults_per_step']['max']} max per step (allocator: {s['config']['allocator']})",
    ]
    return "\n".join(lines)


def json_safe(value):
    """`value` with non-finite floats as strings, so that the file is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_metrics(path: str, summary: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(json_safe(summary), f, indent=1, allow_nan=False)
    os.replace(tmp, path)


def read_metrics(path: str) -> dict:
    """A metrics file written by `write_metrics`; ValueError when it is not one."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"recxla-train --compare: cannot read {path!r}: {e}") from None
    missing = [k for k in REQUIRED_KEYS if k not in data]
    if missing:
        raise ValueError(f"recxla-train --compare: {path!r} is not a recxla-train metrics file "
                         f"(missing {', '.join(missing)})")
    return data




def write_trace(path: str, timeline, meter, rank: int, world: int) -> None:
    """Every rank's timeline spans and metered collectives, gathered to rank 0 and written as
    one Chrome trace (a collective over the job; the clocks are the machine's monotonic clock,
    shared by the ranks of one machine)."""
    import torch.distributed as dist

    from recxla.pipeline.timeline import Timeline, write_chrome_trace

    mine = (timeline.spans if timeline is not None else [],
            [r for r in meter.records if r.done is not None])
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank != 0:
        return
    starts = [s.start for spans, _ in gathered for s in spans] + \
        [r.issued for _, records in gathered for r in records]
    origin = min(starts) if starts else 0.0
    traces = []
    for r, (spans, records) in enumerate(gathered):
        view = Timeline()
        view.spans = list(spans)
        traces.append(view.chrome_trace(rank=r, collectives=records, origin=origin))
    write_chrome_trace(path, traces)
