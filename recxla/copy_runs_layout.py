"""The runs of recxla::copy_runs, as data: what a run's nine ints mean (csrc/include/recxla/
copy_runs.h keeps the same order). A leaf, like recxla.formats: the ops (recxla.ops.copy_runs)
and the Triton kernels (triton_kernels/copy_runs.py) import it, and it imports nothing.
"""

from typing import Iterable, List, NamedTuple

RUN_FIELDS = 9


class Run(NamedTuple):
    """One run: `rows` rows of `width` elements from sources[source] (row i at source_offset
    + i * source_stride) to targets[target] (row i at target_offset + i * target_stride),
    added there with add=1 (recxla.ops.copy_runs); `pack` flattens runs into the op's ints."""

    source: int
    source_offset: int
    source_stride: int
    target: int
    target_offset: int
    target_stride: int
    rows: int
    width: int
    add: int = 0

    def transposed(self) -> "Run":
        """The run that moves the target's elements back to the source (a copy: the
        transpose of an add into a sum reads the sum's gradient once per part)."""
        return Run(self.target, self.target_offset, self.target_stride, self.source,
                   self.source_offset, self.source_stride, self.rows, self.width, 0)


def pack(runs: Iterable[Run]) -> List[int]:
    """The op's `runs` argument: RUN_FIELDS ints per run."""
    return [field for run in runs for field in run]
