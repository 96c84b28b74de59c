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


def build_library(tmp_path, name, *flags, source=SOURCE, suffix="cpp"):
    path = tmp_path / f"{name}.{suffix}"
    path.write_text(source)
    library = tmp_path / f"{name}.so"
    compiler = shutil.which("g++" if suffix == "cpp" else "gcc") or "c++"
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", *flags, str(path), "-o", str(library)],
                   check=True, capture_output=True)
    return str(library)


def test_a_library_defining_the_runtime_is_found(tmp_path):
    setup = load_setup()
    # A C library that defines std::locale::classic() under its mangled name: what a private
    # runtime copy exports, without needing the static libstdc++ archive.
    stub = build_library(tmp_path, "stub", source="void _ZNSt6locale7classicEv(void) {}\n",
                         suffix="c")
    assert setup.private_cxx_runtime(stub) == ["_ZNSt6locale7classicEv"]
    assert setup.private_cxx_runtime(build_library(tmp_path, "shared")) == []


def test_a_statically_linked_runtime_is_found(tmp_path):
    try:
        static = build_library(tmp_path, "static", "-static-libstdc++")
    except subprocess.CalledProcessError as e:
        pytest.skip(f"this toolchain cannot link libstdc++ statically: {e.stderr[-200:]!r}")
    assert load_setup().private_cxx_runtime(static)


def test_the_installed_extension_links_the_shared_runtime():
    from recxla import _extension

    if not _extension.HAVE_EXTENSION:
        pytest.fail("recxla._C is not built")
    import recxla._C as compiled

    assert load_setup().private_cxx_runtime(compiled.__file__) == []
