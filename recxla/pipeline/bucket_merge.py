"""Whether a step's dense buckets leave one by one or together (DenseAllReduce's
`bucket_merge`), and the choice between the two made while training ("auto").

DDP hands the pipeline's comm hook the dense gradients in buckets (1 MB each by default) as the
backward produces them. Sent one by one, each starts while the rest of the backward runs: where
the link binds, that early start is what wins (2 emulated nodes x 2 ranks at 200 Mbit/s: 2.62x
TorchRec's examples/s, against 2.52x with the gradients in one bucket). Sent together once the
last one is ready, a step makes one dense sum instead of one per bucket: on gloo every sum costs
each rank a few collectives' CPU whatever its bytes (bench.cluster.collective_cpu), and where
the CPU binds, fewer collectives win (at 1 Gbit/s together made 1.28x TorchRec's examples/s,
apart 1.26x; at 200 Mbit/s together 2.49x, apart 2.66x; bench/results/training.md). Which one
a cluster needs depends on its links and its cores, so "auto" measures it (1.30x and 2.68x).

"auto" (`MergeTuner`): rank 0 runs blocks of `block` steps each way in turn, `rounds` blocks of
each, keeps the way whose steps took less time (the median step, the first step of each block
left out: it still waits for the other way's sum), and measures again after `recheck` steps.
Its choice travels inside the sums themselves: one value after the step's first bucket, rank 0's
choice for the next step, 0 from every other rank. Every rank reads the same sum at the same
wait(), so the next step goes the same way everywhere, and no collective of its own is made.

"auto" only tunes where the bits cannot depend on it (`bits_independent_of_grouping`): by node on
gloo over at most two nodes, where every value is summed by one rank in rank order inside the
node and as a sum of two terms across the nodes, however the values are grouped into
collectives (recxla.distributed.all_reduce_by_node). Elsewhere (NCCL, gloo's ring over more
ranks) a sum's split, and so its rounding, follows the tensor it is in, and "auto" sends the
buckets one by one; "on" and "off" choose one way for every step, anywhere.
"""

from statistics import median
from typing import Dict, List

import torch.distributed as dist

from recxla.pipeline.choices import BUCKET_MERGE_WIRES
from recxla.pipeline.micro_batches import OWNER


def bits_independent_of_grouping(nodes, wire: str) -> bool:
    """Whether summing the dense gradients by `nodes` (a node layout, or None: one all-reduce
    over DDP's group) on `wire` gives the same bits however the buckets are grouped (module
    docstring)."""
    if nodes is None or wire not in BUCKET_MERGE_WIRES or nodes.num_nodes > 2:
        return False
    return all(dist.get_backend(g) == "gloo" for g in (nodes.shard_group, nodes.replica_group))


class MergeTuner:
    """Rank 0's choice of how each step sends its buckets (module docstring): `propose()` the
    way of a coming step, `record()` each finished one.

    Args:
        block: steps in a row each way while measuring.
        rounds: blocks of each way per measurement.
        recheck: steps the chosen way runs before the next measurement.
        lag: steps from the one whose begin makes a proposal to the one that runs it (1 in
            MicroBatchGradientSync: a proposal rides in its step's sum, which the next step
            reads at its begin). The driver records each step's time before the next
            proposal, so the step that ran proposal c is timed just before proposal c + lag + 1,
            and the measurement waits for its last planned steps' times before it chooses.
    """

    def __init__(self, block: int = 16, rounds: int = 2, recheck: int = 400, lag: int = 1):
        for name, value, least in (("block", block, 2), ("rounds", rounds, 1),
                                   ("recheck", recheck, 1), ("lag", lag, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{OWNER}: MergeTuner's {name} must be an int >= {least}, got "
                                 f"{value!r}")
        self.block, self.rounds, self.recheck, self.lag = block, rounds, recheck, lag
        self.chosen = False  # the way kept after the last measurement (False: one by one)
        self.measurements = 0  # measurements completed
        self._proposals = 0  # proposals made
        self._measure(start=0)

    def _measure(self, start: int) -> None:
        # The measurement's ways, by proposal from proposal `start` on, and the measured times.
        self._planned: List[bool] = [merged for _ in range(self.rounds)
                                     for merged in (False, True) for _ in range(self.block)]
        self._start = start
        self._times: Dict[bool, List[float]] = {False: [], True: []}
        self._measuring = True
        self._left = 0

    def record(self, seconds: float, merged: bool, after_same: bool) -> None:
        """A finished step: its time, whether its buckets went together, and whether the step
        before it went the same way (if not, it also waited for the other way's sum, and is
        left out). Only the steps that ran the measurement's proposals count: the steps
        proposed before it began are still being timed when it starts."""
        planned = self._proposals - 1 - self.lag - self._start
        if self._measuring and after_same and 0 <= planned < len(self._planned):
            self._times[merged].append(seconds)

    def propose(self) -> bool:
        """Whether a coming step sends its buckets together."""
        made, self._proposals = self._proposals, self._proposals + 1
        if self._measuring:
            planned = made - self._start
            if planned < len(self._planned):
                return self._planned[planned]
            if planned < len(self._planned) + self.lag:
                # The last planned steps have not been timed yet: their way goes on meanwhile.
                return self._planned[-1]
            self._measuring = False
            self.measurements += 1
            apart, together = self._times[False], self._times[True]
            self.chosen = bool(apart and together and median(together) < median(apart))
            self._left = self.recheck
        if self._left > 0:
            self._left -= 1
            return self.chosen
        self._measure(start=made)
        return self._planned[0]
