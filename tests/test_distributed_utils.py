"""The helper the distributed tests run their ranks with (distributed_utils.run_distributed)."""

import os

import pytest
import torch
import torch.distributed as dist
from distributed_utils import DistributedTestError, run_distributed

_VARIABLE = "RECXLA_TEST_DISTRIBUTED_UTILS"


def _sum_and_environment(rank, world_size, value):
    t = torch.tensor([float(value + rank)])
    dist.all_reduce(t)
    return rank, float(t), os.environ.get(_VARIABLE), torch.get_num_threads()


def _fail_on_rank(rank, world_size, bad_rank, message):
    if rank == bad_rank:
        raise ValueError(message)
    return rank


def test_ranks_run_with_the_tests_environment_and_return_in_rank_order(monkeypatch, seed):
    # Set after the ranks' server may already have started: a rank must still see it.
    run_distributed(_sum_and_environment, 2, args=(0,))
    monkeypatch.setenv(_VARIABLE, str(seed))
    value = seed % 1000
    results = run_distributed(_sum_and_environment, 3, args=(value,))
    total = float(sum(value + r for r in range(3)))
    assert results == [(r, total, str(seed), 1) for r in range(3)]


def test_a_failing_rank_comes_back_with_its_traceback(seed):
    message = f"boom-{seed}"
    with pytest.raises(DistributedTestError, match=rf"rank 1: ValueError: {message}") as e:
        run_distributed(_fail_on_rank, 2, args=(1, message))
    assert "_fail_on_rank" in str(e.value)  # the child's own traceback
