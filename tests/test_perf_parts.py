"""bench/perf_parts.py's accounting: every perf sample lands in one part by its thread, library
and symbol, the busy parts are scaled to the trainer's CPU per example, and the table's totals
and the row above the dense floor follow from them. (The sampling itself needs perf and a
quiet machine: bench/results/training.md has its figures.)"""

import argparse
import random

import pytest

from bench import perf_parts as pp

# (thread, library, symbol) -> part, as `perf report --sort comm,dso,sym` names them.
SAMPLES = [
    ("swapper", "[kernel.kallsyms]", "pv_native_safe_halt", pp.IDLE),
    ("gloo_tcp_loop", "[kernel.kallsyms]", "tcp_sendmsg", pp.PARTS[5]),
    ("pt_gloo_runloop", "libtorch_cpu.so", "gloo::transport::tcp::Pair::write", pp.PARTS[5]),
    ("python", "libtorch_cpu.so", "mkl_blas_avx512_sgemm_kernel_0", pp.PARTS[0]),
    ("python", "libtorch_cpu.so", "c10::function_ref<void (char**, long const*, long, long)>::"
     "callback_fn<at::native::AVX2::VectorizedLoop2d<at::native::AVX2::direct_copy_kernel>",
     pp.PARTS[1]),
    ("python", "libtorch_cpu.so", "at::native::(anonymous namespace)::cat_serial_kernel",
     pp.PARTS[1]),
    ("python", "libtorch_cpu.so", "c10::impl::OperatorEntry::lookup", pp.PARTS[2]),
    ("python", "libpython3.11.so.1.0", "_PyEval_EvalFrameDefault", pp.PARTS[2]),
    ("python", "libtorch_python.so", "torch::autograd::THPVariable_copy_", pp.PARTS[2]),
    ("python", "libc10.so", "c10::TensorImpl::~TensorImpl", pp.PARTS[2]),
    ("python", "fbgemm_gpu_py.so", "fbgemm::split_embedding_codegen_forward_cpu", pp.PARTS[3]),
    ("python", "_C.abi3.so", "recxla::emb_cpu::run_part_i64", pp.PARTS[4]),
    ("python", "libc.so.6", "_int_malloc", pp.PARTS[6]),
    ("python", "[kernel.kallsyms]", "do_syscall_64", pp.PARTS[6]),
    ("pt_elastic", "libpython3.11.so.1.0", "_PyEval_EvalFrameDefault", pp.PARTS[6]),
]


def report_of(shares):
    lines = ["# Samples: 12K of event 'cpu-clock:ppp'", "#", "# Overhead  Command  Shared Object"]
    for (thread, library, symbol, _), share in zip(SAMPLES, shares):
        kind = "[k]" if library.startswith("[kernel") else "[.]"
        lines.append(f"    {share:5.2f}%  {thread:<16} {library:<24} {kind} {symbol}")
    lines += ["", "#", "# (Cannot load tips.txt file, please install perf!)"]
    return "\n".join(lines)


@pytest.mark.parametrize("thread,library,symbol,part", SAMPLES)
def test_each_sample_lands_in_its_part(thread, library, symbol, part):
    assert pp.part_of(thread, library, symbol) == part


def test_report_shares_sum_by_part_and_scale_to_the_cpu_per_example():
    rng = random.Random()
    shares = [round(rng.uniform(0.01, 9.0), 2) for _ in SAMPLES]
    got = pp.parts_of_report(report_of(shares))
    want = {}
    for (_, _, _, part), share in zip(SAMPLES, shares):
        want[part] = want.get(part, 0.0) + share
    assert got.keys() == want.keys()
    for part in want:
        assert got[part] == pytest.approx(want[part])
    cpu = rng.uniform(20.0, 200.0)
    scaled = pp.per_example(got, cpu)
    assert pp.IDLE not in scaled
    assert sum(scaled.values()) == pytest.approx(cpu)
    busy = sum(v for k, v in want.items() if k != pp.IDLE)
    for part, value in scaled.items():
        assert value == pytest.approx(cpu * want[part] / busy)


def test_no_busy_sample_is_an_error():
    with pytest.raises(ValueError, match="no busy samples"):
        pp.per_example({pp.IDLE: 100.0}, 50.0)


def test_table_totals_and_the_row_above_the_floor():
    a = {pp.PARTS[0]: 20.0, pp.PARTS[2]: 15.5, pp.PARTS[4]: 4.5}
    floor = {pp.PARTS[0]: 20.0, pp.PARTS[2]: 8.0}
    rows = pp.markdown({"recxla": a, pp.FLOOR: floor}).splitlines()
    assert rows[0] == f"| part | recxla | {pp.FLOOR} |"
    assert rows[-2] == "| all: the trainer's CPU per example | 40.0 | 28.0 |"
    assert rows[-1] == "| above the dense floor | 12.0 | 0.0 |"
    assert f"| {pp.PARTS[2]} | 15.5 | 8.0 |" in rows
    assert "above the dense floor" not in pp.markdown({"recxla": a})


def test_run_arguments():
    assert pp.parse_run("dense floor=--baseline torchrec --dense-floor") == (
        "dense floor", ["--baseline", "torchrec", "--dense-floor"])
    for bad in ("no options", "=--dense-floor"):
        with pytest.raises(argparse.ArgumentTypeError, match="LABEL=trainer options"):
            pp.parse_run(bad)
