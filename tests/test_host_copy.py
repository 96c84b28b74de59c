"""recxla.host_copy: host tensors to a device. On the CPU a tensor stays itself; to a GPU it
arrives equal, through pinned memory, and the host tensor is left as it was."""

import pytest
import torch

from recxla.host_copy import int64_on, to_device


def test_on_the_cpu_a_tensor_stays_itself():
    t = torch.randint(0, 100, (17,))
    assert to_device(t, torch.device("cpu")) is t
    assert to_device(t, "cpu") is t
    assert to_device(None, "cpu") is None
    values = torch.randint(-5, 5, (9,)).tolist()
    got = int64_on(iter(values), "cpu")
    assert got.dtype == torch.int64 and got.tolist() == values


@pytest.mark.gpu
def test_to_a_gpu_through_pinned_memory():
    host = torch.randn(1000, 3)
    before = host.clone()
    got = to_device(host, "cuda")
    assert got.is_cuda and torch.equal(got.cpu(), before) and torch.equal(host, before)
    assert not host.is_pinned()  # the pinned copy is the function's own
    pinned = torch.arange(10).pin_memory()
    assert torch.equal(to_device(pinned, "cuda").cpu(), pinned)
    on_gpu = torch.arange(5, device="cuda")
    assert to_device(on_gpu, "cuda") is on_gpu
    assert int64_on([3, 1, 2], "cuda").cpu().tolist() == [3, 1, 2]
