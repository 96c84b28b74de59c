"""The build's check that recxla._C links the shared C++ runtime (setup.py).

An extension linked with a private, static copy of libstdc++ crashes the first time it raises an
error (torch formats the message with the other runtime's streams): the build must refuse it.
"""

import importlib.util
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = """
#include <sstream>
#include <string>
std::string describe(long x) { std::ostringstream s; s << "got " << x; return s.str(); }
"""


def load_setup():
    spec = importlib.util.spec_from_file_location("recxla_setup", os.path.join(ROOT, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # main() runs only as a script
    return module


def build_library(tmp_path, name, *flags):
    source = tmp_path / "describe.cpp"
    source.write_text(SOURCE)
    library = tmp_path / name
    subprocess.run([shutil.which("g++") or "c++", "-shared", "-fPIC", "-O1", *flags, str(source),
                    "-o", str(library)], check=True)
    return str(library)


def test_a_statically_linked_runtime_is_found(tmp_path):
    setup = load_setup()
    static = build_library(tmp_path, "static.so", "-static-libstdc++")
    shared = build_library(tmp_path, "shared.so")
    assert setup.private_cxx_runtime(static)
    assert setup.private_cxx_runtime(shared) == []


def test_the_installed_extension_links_the_shared_runtime():
    from recxla import _extension

    if not _extension.HAVE_EXTENSION:
        pytest.fail("recxla._C is not built")
    import recxla._C as compiled

    assert load_setup().private_cxx_runtime(compiled.__file__) == []
