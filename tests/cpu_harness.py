"""Builds a test harness: a C++ file that replays a GPU kernel's lane code on the CPU (the
kernel's own `__host__ __device__` header), compiled with g++ into a library the test calls
through ctypes."""

import ctypes
import os
import shutil
import subprocess

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build(source: str, directory) -> ctypes.CDLL:
    """tests/`source` compiled into `directory` with the extension's own CPU flags where they
    matter for the math: C++20, no FMA contraction."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.fail("no C++ compiler on PATH: the extension itself needs one to build")
    library = os.path.join(str(directory), os.path.splitext(source)[0] + ".so")
    torch_include = os.path.join(os.path.dirname(torch.__file__), "include")
    subprocess.run([compiler, "-std=c++20", "-O2", "-ffp-contract=off", "-shared", "-fPIC",
                    "-I", os.path.join(ROOT, "csrc", "include"), "-I", torch_include,
                    os.path.join(ROOT, "tests", source), "-o", library],
                   check=True, capture_output=True, text=True)
    return ctypes.CDLL(library)
