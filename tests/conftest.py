"""Shared test setup: a fresh seed per test, and the `gpu` marker's skip when no GPU is visible."""

import os
import random

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


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
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device: run `make gpu-check` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
