"""The build: the extension loads, reports truthfully what it compiled, and covers every op on
every backend it compiled (a CPU kernel without its CUDA twin would make CUDA tensors fail only
on a GPU machine, long after CI)."""

import importlib
import importlib.util
import os
import pkgutil
import subprocess
import sys

import pytest
import torch

import recxla
import recxla.ops
from recxla import _extension

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def recxla_ops_with_kernel(dispatch_key):
    return sorted(
        name
        for name in torch._C._dispatch_get_registrations_for_dispatch_key(dispatch_key)
        if name.startswith("recxla::")
    )


def load_setup_py():
    """setup.py as a module (its setup() call runs only as __main__)."""
    spec = importlib.util.spec_from_file_location("recxla_setup", os.path.join(ROOT, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_extension_is_loaded():
    assert _extension.HAVE_EXTENSION, f"recxla._C failed to load: {_extension._LOAD_ERROR}"
    assert "recxla::quantize_fp8_rows" in recxla_ops_with_kernel("CPU")


# Run as Python's startup hook (sitecustomize) in a child process: `recxla._C` then fails to
# import, as on a checkout that was never built.
_BLOCK_EXTENSION = """
import sys


class _NoExtension:
    def find_spec(self, name, path=None, target=None):
        if name == "recxla._C":
            raise ImportError("recxla._C blocked by test_build.py")


sys.meta_path.insert(0, _NoExtension())
"""


def _run_without_extension(tmp_path, *args):
    (tmp_path / "sitecustomize.py").write_text(_BLOCK_EXTENSION)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_suite_stops_when_the_kernels_did_not_load(tmp_path):
    """Without the extension every op raises: the run stops at once, saying to build it."""
    tests = ["tests/test_build.py::test_extension_is_loaded",
             "tests/test_fp8_rows.py::test_zero_rows_round_trip_exactly"]
    run = _run_without_extension(tmp_path, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests)
    output = run.stdout + run.stderr
    assert run.returncode != 0, output
    assert "recxla._C failed to load (recxla._C blocked by test_build.py)" in output, output
    assert "`make build`" in output, output


_IMPORT_THEN_CALL = """
import torch
import recxla
import recxla.data
import recxla.ops.embedding_bag
import recxla.ops.route_ids
try:
    recxla.quantize_rows(torch.ones(2, 4))
except RuntimeError as e:
    print("raised:", e)
"""


def test_import_works_without_the_extension_and_ops_say_to_reinstall(tmp_path):
    """A checkout that was never built still imports (recxla.data is pure Python); an op then
    raises an error naming it and saying how to reinstall, not a bare AttributeError from
    torch.ops."""
    run = _run_without_extension(tmp_path, "-c", _IMPORT_THEN_CALL)
    assert run.returncode == 0, run.stdout + run.stderr
    assert ("raised: recxla.quantize_rows: the compiled kernels are not available (recxla._C "
            "blocked by test_build.py); reinstall recxla with `pip install "
            "--no-build-isolation .`") in run.stdout, run.stdout + run.stderr


def test_build_reports_what_it_built():
    # The library's own record of its link step: a CUDA build needs torch's CUDA runtime.
    with open(recxla._C.__file__, "rb") as f:
        linked_to_cuda = b"libc10_cuda.so" in f.read()
    assert recxla.built_with_cuda() == linked_to_cuda
    has_cuda_kernel = torch._C._dispatch_has_kernel_for_dispatch_key(
        "recxla::quantize_fp8_rows", "CUDA")
    assert recxla.built_with_cuda() == has_cuda_kernel
    # And it built what setup.py decides for this machine: CUDA whenever torch is a CUDA build and
    # a toolkit is found, GPU or not.
    want_cuda, why_not = load_setup_py()._want_cuda(torch)
    assert recxla.built_with_cuda() == want_cuda, (
        f"setup.py would build CUDA kernels: {want_cuda} ({why_not or 'toolkit found'}); the "
        f"build did: {recxla.built_with_cuda()}. Rebuild with `make setup`.")


# Ops whose inputs live on the host by design: a sharded module routes, packs and decodes its ids
# on the CPU, where the loader delivers them, whatever device holds the tables
# (recxla/ops/route_ids.py, recxla/ops/id_blocks.py, recxla/ops/row_ids.py).
HOST_OPS = {"recxla::route_ids", "recxla::pack_id_blocks", "recxla::decode_id_blocks",
            "recxla::encode_row_ids", "recxla::expand_row_plan"}


def test_every_cpu_op_has_a_cuda_kernel():
    if not recxla.built_with_cuda():
        pytest.skip("this build has no CUDA kernels")
    missing = [
        name for name in recxla_ops_with_kernel("CPU")
        if name not in HOST_OPS and not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA")
    ]
    assert not missing, f"ops with a CPU kernel but no CUDA kernel: {missing}"


def test_every_op_has_a_fake_kernel():
    # torch.compile and opcheck trace ops through their fake kernels (recxla/ops/<family>.py).
    for module in pkgutil.iter_modules(recxla.ops.__path__):
        importlib.import_module(f"recxla.ops.{module.name}")
    from torch._library.simple_registry import singleton

    ops = recxla_ops_with_kernel("CPU")
    missing = [name for name in ops if singleton.find(name).fake_impl.kernel is None]
    assert not missing, f"ops without a fake kernel (torch.library.register_fake): {missing}"
