"""Shared test setup: a fresh seed per test, the `gpu` marker's skip when no GPU is visible, and a
loud stop when the compiled kernels did not load (unless RECXLA_ALLOW_REFERENCE_ONLY=1)."""

import os
import random

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
# Set to 1 to run the suite on the PyTorch reference alone, on purpose (a build without a
# compiler): the kernel-vs-reference tests then compare the reference with itself.
ALLOW_REFERENCE_ONLY = "RECXLA_ALLOW_REFERENCE_ONLY"


def pytest_configure(config):
    """recxla falls back to its reference ops when `recxla._C` fails to load; the tests would then
    pass while testing no kernel at all. Stop the run instead, saying why."""
    from recxla import _extension

    if not _extension.HAVE_EXTENSION and os.environ.get(ALLOW_REFERENCE_ONLY) != "1":
        raise pytest.UsageError(
            f"recxla._C failed to load ({_extension._LOAD_ERROR}): every op would run its "
            "PyTorch reference and the kernel tests would compare the reference with itself. "
            "Build it (`make build`), or set RECXLA_ALLOW_REFERENCE_ONLY=1 if a reference-only "
            "run is what you want."
        )


@pytest.fixture(autouse=True)
def seed():
    """Fresh random inputs every run (the seed is printed on failure), reproducible on demand
    with RECXLA_TEST_SEED."""
    value = int(os.environ.get("RECXLA_TEST_SEED", random.randrange(2**31)))
    torch.manual_seed(value)
    random.seed(value)
    yield value


def pytest_runtest_makereport(item, call):
    if call.when == "call" and call.excinfo is not None and "seed" in item.fixturenames:
        seed_value = item.funcargs.get("seed")
        item.add_report_section("call", "seed", f"RECXLA_TEST_SEED={seed_value}")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device: run `make gpu-campaign` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
