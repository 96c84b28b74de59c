"""Build recxla and its extension `recxla._C`.

The C++ CPU kernels are always built. The CUDA kernels are built whenever the installed torch is a
CUDA build and a CUDA toolkit (nvcc) is found; a visible GPU is not needed, so a CPU-only machine
with the toolkit compiles and links them too. `RECXLA_FORCE_CPU=1` builds the CPU kernels only.
The architectures default to sm_80 and sm_90 and follow `TORCH_CUDA_ARCH_LIST` when it is set.

`RECXLA_SKIP_EXTENSION=1` installs the package without compiling the extension: the Makefile's
editable install does that, and `setup.py build_ext --inplace` then compiles it once, with ninja
keeping the objects under build/ for later rebuilds (an editable install compiles in a temporary
folder that pip deletes, so compiling there too would compile every unit twice).
"""

import glob
import os
import shutil
import subprocess
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CUDA_ARCHS = "8.0;9.0"


def _find_cuda_home():
    """The toolkit's install folder: torch's own guess follows the nvcc on PATH, which may be a
    wrapper script outside the toolkit, and then the link fails with `cannot find -lcudart`."""
    for candidate in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if candidate and os.path.exists(os.path.join(candidate, "bin", "nvcc")):
            return candidate
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = os.path.realpath(nvcc)
        with open(real, "rb") as f:
            head = f.read(4096)
        if head.startswith(b"#!"):  # a wrapper: look for the toolkit path it execs
            for token in head.decode(errors="ignore").split():
                if token.endswith("/bin/nvcc") and os.path.exists(token):
                    real = token
                    break
        home = os.path.dirname(os.path.dirname(real))
        if os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
            return home
    for candidate in sorted(glob.glob("/usr/local/cuda*"), reverse=True):
        if os.path.exists(os.path.join(candidate, "bin", "nvcc")):
            return candidate
    return None


def _want_cuda(torch):
    if os.environ.get("RECXLA_FORCE_CPU", "0") == "1":
        return False, "RECXLA_FORCE_CPU=1"
    if torch.version.cuda is None:
        return False, "torch is a CPU-only build"
    if _find_cuda_home() is None:
        return False, "no CUDA toolkit (nvcc) found"
    return True, ""


def _nvidia_include_dirs():
    """Headers that ship in the nvidia-* wheels torch depends on (cublas, cusparse, ...)."""
    dirs = []
    for path in sys.path:
        dirs += glob.glob(os.path.join(path, "nvidia", "*", "include"))
        dirs += glob.glob(os.path.join(path, "nvidia", "cu*", "include"))
    return sorted(set(d for d in dirs if os.path.isdir(d)))


def get_extensions():
    import torch
    from torch.utils import cpp_extension

    use_cuda, why_not = _want_cuda(torch)
    if use_cuda:
        os.environ["CUDA_HOME"] = _find_cuda_home()
        cpp_extension.CUDA_HOME = os.environ["CUDA_HOME"]
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)

    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    sources += sorted(glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    cxx_flags = [
        "-O3",
        "-std=c++20",
        # Bit-exact codes on every backend: never fuse a multiply and an add into one rounding.
        "-ffp-contract=off",
        "-fopenmp",
    ]
    extra_compile_args = {"cxx": cxx_flags}
    macros = []
    include_dirs = [os.path.join(ROOT, "csrc", "include")]
    if use_cuda:
        sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
        extra_compile_args["nvcc"] = [
            "-O3",
            "-std=c++20",
            "--fmad=false",
            "--expt-relaxed-constexpr",
        ]
        macros.append(("RECXLA_WITH_CUDA", "1"))
        include_dirs += _nvidia_include_dirs()
        ext_cls = cpp_extension.CUDAExtension
        print(
            f"recxla: building CPU and CUDA kernels (archs {os.environ['TORCH_CUDA_ARCH_LIST']},"
            f" CUDA_HOME={os.environ['CUDA_HOME']})",
            flush=True,
        )
    else:
        ext_cls = cpp_extension.CppExtension
        print(f"recxla: building CPU kernels only ({why_not})", flush=True)

    return [
        ext_cls(
            "recxla._C",
            sources,
            include_dirs=include_dirs,
            define_macros=macros,
            extra_compile_args=extra_compile_args,
            extra_link_args=["-fopenmp"],
            py_limited_api=True,
        )
    ]


# Functions only the C++ runtime itself defines. An extension that defines them carries a private
# copy of libstdc++ (its compiler links the runtime statically, as one GPU machine's /opt/gcc g++
# did): torch's error messages and streams then cross two runtimes, and the first error raised
# inside the extension crashes the process (a segfault in std::ostream).
CXX_RUNTIME_SYMBOLS = ("_ZNSt6locale7classicEv", "_ZNSt8ios_base4InitC1Ev")


def private_cxx_runtime(library: str) -> list:
    """The C++ runtime functions that `library` defines itself (empty for a sound build, and
    where binutils' nm is missing)."""
    found = set()
    for table in (["--defined-only"], ["-D", "--defined-only"]):
        try:
            listing = subprocess.run(["nm", *table, library], capture_output=True, text=True,
                                     check=False).stdout
        except OSError:
            return []
        found.update(line.split()[-1] for line in listing.splitlines() if line.strip())
    return [name for name in CXX_RUNTIME_SYMBOLS if name in found]


def build_ext_class():
    from torch.utils.cpp_extension import BuildExtension

    class BuildExtensionChecked(BuildExtension):
        """torch's builder, then a check that the extension links the shared C++ runtime."""

        def build_extension(self, ext):
            super().build_extension(ext)
            library = self.get_ext_fullpath(ext.name)
            if private_cxx_runtime(library):
                os.remove(library)  # never left where `import recxla` would load it
                compiler = os.environ.get("CXX") or shutil.which("c++") or "c++"
                raise RuntimeError(
                    f"recxla: {library} carries its own copy of the C++ runtime (libstdc++): the "
                    f"compiler ({compiler}) or LDFLAGS link it statically, and the extension would "
                    "crash the first time it raises an error. Build with the compiler torch was "
                    "built with, e.g. CC=/usr/bin/gcc CXX=/usr/bin/g++ and /usr/bin first on PATH "
                    "(nvcc's host compiler is the first g++ on PATH).")

    return BuildExtensionChecked.with_options(use_ninja=True)


def main():
    setup(
        name="recxla",
        version="0.1.0",
        description="Fast communication and embedding kernels for TorchRec recommendation training",
        packages=find_packages(include=["recxla", "recxla.*"]) + ["recxla.triton_kernels"],
        # The Triton kernels live at the top level of the source tree but install inside the
        # package: a bare top-level `triton_kernels` name belongs to another project.
        package_dir={"recxla.triton_kernels": "triton_kernels"},
        ext_modules=[] if os.environ.get("RECXLA_SKIP_EXTENSION", "0") == "1" else
        get_extensions(),
        cmdclass={"build_ext": build_ext_class()},
        options={"bdist_wheel": {"py_limited_api": "cp39"}},
        python_requires=">=3.10",
        install_requires=["torch>=2.14", "pyarrow>=20", "zstandard>=0.22"],
        extras_require={"ray": ["ray[data]>=2.50"], "plot": ["matplotlib>=3.8"],
                        "iceberg": ["pyiceberg[sql-sqlite,pyarrow]>=0.10", "pyiceberg-core>=0.5"]},
        entry_points={"console_scripts": ["recxla-train = recxla.train.cli:entry"]},
    )


if __name__ == "__main__":
    main()
