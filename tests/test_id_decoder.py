"""The owner's reorder of received ids: segments laid out (source, group, micro-batch) go to
(group, micro-batch, source), ids and weights alike, against a plain loop over the segments
on random sizes (empty segments included): FBGEMM's permute on CPU and the gather index that
other devices take."""

import pytest
import torch

from recxla.torchrec.id_decoder import _permute_segments, segment_gather


def permute_ref(sizes, values):
    world, groups, micro = sizes.shape
    starts, position = {}, 0
    for s in range(world):
        for g in range(groups):
            for k in range(micro):
                starts[s, g, k] = position
                position += int(sizes[s, g, k])
    pieces = [values[starts[s, g, k]: starts[s, g, k] + int(sizes[s, g, k])]
              for g in range(groups) for k in range(micro) for s in range(world)]
    return torch.cat(pieces) if pieces else values[:0]


@pytest.mark.parametrize("shape", [(1, 1, 1), (4, 7, 1), (3, 5, 4), (2, 1, 3), (4, 0, 1)])
@pytest.mark.parametrize("weighted", [False, True])
def test_permute_segments_matches_the_loop(shape, weighted):
    sizes = torch.randint(0, 20, shape, dtype=torch.int64)
    if sizes.numel():
        sizes.view(-1)[torch.randint(0, sizes.numel(), ())] = 0  # an empty segment
    total = int(sizes.sum())
    values = torch.randint(0, 2**40, (total,), dtype=torch.int64)
    weights = torch.rand(total) if weighted else None
    got, got_weights = _permute_segments(sizes, values, weights)
    assert torch.equal(got, permute_ref(sizes, values))
    if weighted:
        assert torch.equal(got_weights, permute_ref(sizes, weights))
    else:
        assert got_weights is None
    # The GPU's path (a gather index), run here on CPU tensors.
    gather = segment_gather(sizes, total)
    assert torch.equal(values.index_select(0, gather), permute_ref(sizes, values))
