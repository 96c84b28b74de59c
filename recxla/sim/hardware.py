"""Machines the scaling model knows: links, latencies and kernel throughputs, each with its
source.

Every rate is per GPU (per rank) and per direction, in bytes or FLOPs per second. Published
figures are the vendors' (cited beside each preset); figures of this project's CPU machine come
from the results files under bench/results/. Two numbers have no public source and are stated as
assumptions: the share of peak FLOPs a recommendation model's dense layers reach
(`dense_efficiency`) and the per-message latencies of the links (small next to the transfers at
the batch sizes modeled; they matter only for tiny per-peer messages).
"""

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Hardware:
    """One node type.

    gpus_per_node: ranks per node, G.
    intra_bytes_per_s / intra_latency_s: one rank's link to the other ranks of its node, one
        direction (NVLink through NVSwitch on a GPU node).
    inter_bytes_per_s / inter_latency_s: one rank's share of its node's network, one direction.
    peak_flops: dense matrix throughput of one rank (bf16 on a GPU).
    dense_efficiency: the share of peak_flops the dense layers of a recommendation model reach.
    memory_bytes_per_s: what embedding lookups, pooling and the sparse optimizer stream at.
    codec_bytes_per_s: fp32 bytes per second the FP8 row codec quantizes and dequantizes
        (both together); it reads fp32 and writes a quarter of it, so it runs at memory speed.
    source: where the figures come from.
    fixed_step_s: time a step costs whatever its size (kernel launches, Python, bookkeeping).
        No public figure for a TorchRec step: 0 unless measured (a one-node step of the real
        model minus the model's terms for it), so short steps come out optimistic.
    """

    name: str
    gpus_per_node: int
    intra_bytes_per_s: float
    intra_latency_s: float
    inter_bytes_per_s: float
    inter_latency_s: float
    peak_flops: float
    dense_efficiency: float
    memory_bytes_per_s: float
    codec_bytes_per_s: float
    source: str = ""
    fixed_step_s: float = 0.0

    def __post_init__(self):
        for field in ("gpus_per_node", "intra_bytes_per_s", "inter_bytes_per_s", "peak_flops",
                      "dense_efficiency", "memory_bytes_per_s", "codec_bytes_per_s"):
            if not getattr(self, field) > 0:
                raise ValueError(f"recxla.sim.Hardware {self.name}: {field} must be > 0")
        for field in ("intra_latency_s", "inter_latency_s", "fixed_step_s"):
            if getattr(self, field) < 0:
                raise ValueError(f"recxla.sim.Hardware {self.name}: {field} must be >= 0")

    @property
    def dense_flops(self) -> float:
        """FLOPs per second the dense layers get."""
        return self.peak_flops * self.dense_efficiency

    def scaled(self, **factors: float) -> "Hardware":
        """A copy with some rates multiplied (`intra_bytes_per_s=2.0` doubles NVLink)."""
        return replace(self, **{k: getattr(self, k) * v for k, v in factors.items()})


# Assumptions (no public measurement): a recommendation model's MLPs and interactions reach
# about a third of bf16 peak (small layers, batch of a few thousand); messages cost a few
# microseconds on NVLink and InfiniBand, more through AWS EFA's SRD.
DENSE_EFFICIENCY = 0.35
NVLINK_LATENCY_S = 2e-6
IB_LATENCY_S = 3e-6
EFA_LATENCY_S = 15e-6

# NVIDIA H100 SXM5 datasheet: 989 TFLOPS dense BF16, 3.35 TB/s HBM3, NVLink 4 at 900 GB/s per
# GPU (both directions together: 450 GB/s each way). NVIDIA DGX H100: 8 GPUs, eight ConnectX-7
# 400 Gb/s InfiniBand NDR ports, one per GPU (50 GB/s each way).
H100_IB = Hardware(
    name="h100-ib",
    gpus_per_node=8,
    intra_bytes_per_s=450e9,
    intra_latency_s=NVLINK_LATENCY_S,
    inter_bytes_per_s=50e9,
    inter_latency_s=IB_LATENCY_S,
    peak_flops=989e12,
    dense_efficiency=DENSE_EFFICIENCY,
    memory_bytes_per_s=3.35e12,
    codec_bytes_per_s=3.35e12 * 0.8,  # read 4 bytes, write ~1.03 per value: memory bound
    source="NVIDIA H100 SXM5 datasheet; NVIDIA DGX H100 (8x ConnectX-7 400Gb/s NDR)",
)

# AWS p5.48xlarge: 8x H100 SXM, 3,200 Gbps EFAv2 per instance (400 GB/s: 50 GB/s per GPU).
H100_P5 = replace(
    H100_IB, name="h100-p5", inter_latency_s=EFA_LATENCY_S,
    source="AWS p5.48xlarge: 8x H100 SXM, 3200 Gbps EFA per instance; H100 datasheet",
)

# AWS p4d.24xlarge: 8x A100 40 GB SXM4 (312 TFLOPS dense BF16, 1,555 GB/s HBM2, NVLink 3 at
# 600 GB/s per GPU: 300 GB/s each way), 400 Gbps EFA per instance (50 GB/s: 6.25 GB/s per GPU).
A100_P4D = Hardware(
    name="a100-p4d",
    gpus_per_node=8,
    intra_bytes_per_s=300e9,
    intra_latency_s=NVLINK_LATENCY_S,
    inter_bytes_per_s=400e9 / 8 / 8,
    inter_latency_s=EFA_LATENCY_S,
    peak_flops=312e12,
    dense_efficiency=DENSE_EFFICIENCY,
    memory_bytes_per_s=1.555e12,
    codec_bytes_per_s=1.555e12 * 0.8,
    source="AWS p4d.24xlarge: 8x A100 40GB, 400 Gbps EFA per instance; A100 datasheet",
)


def emulated(link_gbit: float = 1.0, ranks_per_node: int = 2) -> Hardware:
    """This project's emulated cluster (DESIGN.md, bench/cluster/): CPU ranks in network
    namespaces, nodes joined by veths shaped to `link_gbit`, gloo over TCP.

    Measured here (bench/results/quantized_all_to_all.md, embedding_bag.md, fp8_rows.md):
    - across nodes, one rank per node: gloo gets about half the link each way when a pair
      sends and receives at once (16 MiB per rank all-to-all, 2 x 1 at 0.953 Gbit/s: 8 MiB
      each way in 141.7 ms, 0.49 of the link); two ranks per node fill it better (2 x 2 at
      0.965 Gbit/s: 8 MiB of each rank's 12 crossed in 162.9 ms, 0.43 of the link per rank,
      0.85 for the node);
    - inside a node (loopback): 16 MiB per rank all-to-all between 2 ranks in 5.07 ms, 8 MiB
      each way: 1.65 GB/s;
    - lookups: recxla's EmbeddingBagCollection forward, 701k ids of dim 64 in 12 ms on 2
      threads (15 GB/s of rows pooled); the ranks of a node share those 2 cores;
    - FP8 codec: 16 MiB of fp32 rows quantized (1.3 ms) and dequantized (2.0 ms) on one core.
    Dense layers: the 2 cores' AVX-512 peak (2 x 2 x 16 fp32 FMA lanes x 2 FLOPs at about
    2.5 GHz = 320 GFLOP/s), shared by the ranks of a node, at DENSE_EFFICIENCY.
    """
    if not link_gbit > 0 or ranks_per_node < 1:
        raise ValueError("recxla.sim.emulated: link_gbit must be > 0 and ranks_per_node >= 1")
    share = 1.0 / ranks_per_node  # the node's 2 cores split between its ranks
    return Hardware(
        name=f"emulated-{link_gbit:g}gbit-{ranks_per_node}rpn",
        gpus_per_node=ranks_per_node,
        intra_bytes_per_s=8 * 2**20 / 5.07e-3,
        intra_latency_s=50e-6,
        inter_bytes_per_s=link_gbit * 1e9 / 8 * (0.49 if ranks_per_node == 1
                                                  else 0.85 / ranks_per_node),
        inter_latency_s=100e-6,
        peak_flops=320e9 * share,
        dense_efficiency=DENSE_EFFICIENCY,
        memory_bytes_per_s=701_491 * 64 * 4 / 12e-3 * share,
        codec_bytes_per_s=16 * 2**20 / 3.3e-3 * share * 2,
        source="bench/results/quantized_all_to_all.md, embedding_bag.md, fp8_rows.md",
    )


PRESETS = {h.name: h for h in (H100_IB, H100_P5, A100_P4D)}


def preset(name: str) -> Hardware:
    """A named preset: h100-ib, h100-p5, a100-p4d, or emulated-<gbit>gbit-<ranks>rpn."""
    if name in PRESETS:
        return PRESETS[name]
    if name.startswith("emulated-"):
        try:
            rate, ranks = name[len("emulated-"):].split("gbit-")
            return emulated(float(rate), int(ranks.rstrip("rpn")))
        except ValueError:
            pass
    raise ValueError(f"recxla.sim: unknown hardware {name!r}; choose one of {sorted(PRESETS)} "
                     "or emulated-<gbit>gbit-<ranks>rpn")
