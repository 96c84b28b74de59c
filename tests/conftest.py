"""Shared test setup: a fresh seed per test, the `gpu` marker's skip when no GPU is visible, and a
stop, saying to build it, when the compiled extension did not load."""

import os
import random

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def pytest_configure(config):
    """Without `recxla._C` every op raises (recxla has no plain-PyTorch fallback), so a run
    would only report that error test after test. Stop it at once instead, saying why."""
    from recxla import _extension

    if not _extension.HAVE_EXTENSION:
        raise pytest.UsageError(
            f"recxla._C failed to load ({_extension._LOAD_ERROR}): the ops have no kernels to "
            "run. Build it first (`make build`)."
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
