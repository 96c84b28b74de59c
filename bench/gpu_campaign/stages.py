"""The campaign's stages, in the order they run, with their budgets (seconds).

On a GPU machine (recorded in docs/gpu.md as it was planned: about 8 minutes in all):

| stage | budget | what | dry run (CPU) |
|---|---|---|---|
| env | 60 | device, driver, versions; carried wheels (.whl) into /tmp/site | versions only |
| build | 200 | `pip install --no-build-isolation --no-deps .` for the device's architecture on all cores (the README's path), the extension put beside the sources | `setup.py build_ext --inplace` (the nvcc build, incremental) |
| tests-cuda, tests-triton | 170 each | `pytest -m gpu` with RECXLA_BACKEND=cuda / triton, 90 s per test | the GPU tests are collected |
| memcheck, racecheck | 150 each | compute-sanitizer over small calls of every CUDA kernel and variant (sanitize_cases.py) | the same calls on CPU tensors |
| kernels | 5 x 50 | each family's variants checked, then timed against plain PyTorch, torch.compile and a device copy; the winner per family | the same code on CPU, small sizes, Triton interpreted |
| trainer | 240 | the trainer on one GPU, pipelined against sequential and against its batches made inline (where pipelined and sequential differ, each of pipelined's features alone too), a torch.profiler trace and its stream overlap; the sequence model (`--model history`) pipelined against sequential | the same on CPU, 2 ranks of gloo, a few steps |

The tests and sanitizer stages only check, so they run at once; the timing stages run alone.
"""

import glob
import json
import os
import re
import shutil
import xml.etree.ElementTree as ElementTree

from bench.gpu_campaign.run import ROOT, Campaign, StageResult

KERNEL_MODULES = ("fp8_rows", "dedup", "cluster", "embedding_bag", "copy_runs")
# A dry run's CPU stands in for the GPU and may share its 2 cores with other jobs: its stages get
# this much whatever their GPU budget (the deadline still bounds the whole run).
DRY_RUN_BUDGET_S = 240
WHEELS = os.path.join(ROOT, ".whl")
WHEEL_SITE = "/tmp/recxla-site"

_ENV_PROBE = r"""
import json, os, platform, sys
import torch
info = {"python": platform.python_version(), "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
try:
    import triton
    info["triton"] = triton.__version__
except ImportError:
    info["triton"] = None
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(device=p.name, capability=p.major * 10 + p.minor, sms=p.multi_processor_count,
                memory_gib=round(p.total_memory / 2**30, 1),
                l2_mib=round(getattr(p, "L2_cache_size", 0) / 2**20, 1))
with open("/proc/cpuinfo") as f:
    info["cpu"] = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "?")
info["cpu_cores"] = os.cpu_count()
print(json.dumps(info))
"""


def env(c: Campaign) -> StageResult:
    notes = []
    if not c.dry_run and glob.glob(os.path.join(WHEELS, "*.whl")):
        cmd = c.command([c.python, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                         "--no-compile", "--no-cache-dir", "--upgrade", "--target", WHEEL_SITE,
                         *sorted(glob.glob(os.path.join(WHEELS, "*.whl")))], "wheels.log", 60)
        if cmd.returncode == 0:
            c.env["PYTHONPATH"] = os.pathsep.join([c.env["PYTHONPATH"], WHEEL_SITE])
            notes.append(f"{len(glob.glob(os.path.join(WHEELS, '*.whl')))} wheels installed")
        else:
            notes.append("the carried wheels failed to install (wheels.log)")
    cmd = c.command([c.python, "-c", _ENV_PROBE], "env_probe.log", 60)
    info = {}
    if cmd.returncode == 0:
        info = json.loads(c.tail("env_probe.log", 1))
    nvidia = c.command(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                        "--format=csv,noheader"], "nvidia_smi.log", 20) \
        if shutil.which("nvidia-smi") else None
    if nvidia is not None and nvidia.returncode == 0:
        info["nvidia_smi"] = c.tail("nvidia_smi.log", 1).strip()
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if os.path.exists(nvcc) and c.command([nvcc, "--version"], "nvcc.log", 20).returncode == 0:
        info["nvcc"] = c.tail("nvcc.log", 2).strip().splitlines()[0]
    info["commit"] = os.environ.get("RECXLA_COMMIT") or _git_commit()
    c.write_json("env.json", info)
    if not info.get("torch"):
        return StageResult("fail", "python could not import torch (env_probe.log)", info)
    if not c.dry_run and not info.get("cuda_available"):
        return StageResult("fail", "no CUDA device visible: this is the GPU campaign", info)
    device = info.get("device", "no GPU (dry run)")
    return StageResult("pass", "; ".join([f"{device}, torch {info['torch']}, "
                                          f"triton {info.get('triton')}"] + notes), info)


def _git_commit() -> str:
    head = os.path.join(ROOT, ".git", "HEAD")
    try:
        with open(head) as f:
            ref = f.read().strip()
        if ref.startswith("ref: "):
            with open(os.path.join(ROOT, ".git", ref[5:])) as f:
                return f.read().strip()[:12]
        return ref[:12]
    except OSError:
        return "unknown"


def build(c: Campaign) -> StageResult:
    env = dict(c.env)
    if c.dry_run:
        # The Makefile's in-place build, under its lock (a `make` running beside it builds too).
        lock = ["flock", os.path.join(ROOT, ".build.lock")] if shutil.which("flock") else []
        cmd = c.command(lock + [c.python, "setup.py", "-q", "build_ext", "--inplace"],
                        "build.log", 600, env=env)
    else:
        info = c.read_json("env.json")
        cap = info.get("capability", 90)
        env["TORCH_CUDA_ARCH_LIST"] = f"{cap // 10}.{cap % 10}"
        env["MAX_JOBS"] = str(os.cpu_count() or 8)
        nvcc = shutil.which("nvcc")
        if nvcc and "CUDA_HOME" not in env:
            env["CUDA_HOME"] = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
        # The compiler torch was built with: a g++ that links libstdc++ statically breaks the
        # extension's error path (setup.py refuses such a build; bench/results/gpu.md).
        if os.path.exists("/usr/bin/g++"):
            env.update(CC="/usr/bin/gcc", CXX="/usr/bin/g++",
                       PATH="/usr/bin:" + env.get("PATH", ""))
        cmd = c.command([c.python, "-m", "pip", "install", "--no-build-isolation", "--no-deps",
                         "-v", "."], "build.log", 200, env=env)
        if cmd.returncode == 0:
            _use_installed_extension(c)
    if cmd.returncode != 0:
        return StageResult("timeout" if cmd.timed_out else "fail",
                           f"build failed (build.log): {first_error(c.tail('build.log', 400))}")
    probe = c.command([c.python, "-c", "import recxla; print(recxla.built_with_cuda())"],
                      "build_probe.log", 60)
    with_cuda = c.tail("build_probe.log", 1).strip() == "True"
    if probe.returncode != 0 or not with_cuda:
        return StageResult("fail", "recxla imports without its CUDA kernels (build_probe.log)")
    return StageResult("pass", f"built with CUDA kernels in {cmd.seconds:.0f} s",
                       {"build_s": round(cmd.seconds, 1)})


def first_error(log: str) -> str:
    """The first line of a build log that names an error (else its last line)."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    found = next((ln for ln in lines if " error" in ln or ln.startswith("error")), None)
    return (found or (lines[-1] if lines else "no output"))[:240]


def _use_installed_extension(c: Campaign) -> None:
    """The tests import recxla from the source tree: put the extension pip built there."""
    installed = dict(c.env, PYTHONPATH=os.pathsep.join(
        p for p in c.env["PYTHONPATH"].split(os.pathsep) if p and p != ROOT))
    probe = c.command([c.python, "-c", "import recxla._C as m; print(m.__file__)"],
                      "build_locate.log", 60, env=installed, cwd="/tmp")
    if probe.returncode == 0:
        shutil.copy(c.tail("build_locate.log", 1).strip(), os.path.join(ROOT, "recxla"))
    link = os.path.join(ROOT, "recxla", "triton_kernels")
    if not os.path.exists(link):
        os.symlink(os.path.join("..", "triton_kernels"), link)


def _tests(c: Campaign, backend: str) -> StageResult:
    env = dict(c.env, RECXLA_BACKEND=backend)
    junit = c.path(f"tests_{backend}.xml")
    argv = [c.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests", "-m", "gpu"]
    if c.options.get("tests_k"):
        argv += ["-k", c.options["tests_k"]]
    if c.dry_run:
        cmd = c.command(argv + ["--collect-only"], f"tests_{backend}.log", 120, env=env)
        found = re.search(r"(\d+)(?:/\d+)? tests? collected", c.tail(f"tests_{backend}.log", 3))
        count = int(found.group(1)) if found else 0
        ok = cmd.returncode == 0 and count > 0
        return StageResult("pass" if ok else "fail",
                           f"{count} GPU tests collected (run on a GPU only)", {"collected": count})
    cmd = c.command(argv + ["-v", "--timeout", "90", "-rfE", f"--junitxml={junit}"],
                    f"tests_{backend}.log", 170, env=env)
    counts = junit_counts(junit)
    if counts["tests"] == 0:  # killed at its budget: pytest writes junit only at the end
        counts = verbose_counts(c.tail(f"tests_{backend}.log", 100000))
    failed = counts["failures"] + counts["errors"]
    status = "timeout" if cmd.timed_out else ("pass" if cmd.returncode == 0 and not failed
                                              else "fail")
    return StageResult(status, f"{counts['passed']} passed, {failed} failed, "
                               f"{counts['skipped']} skipped", counts)


def junit_counts(path: str) -> dict:
    """{tests, passed, failures, errors, skipped, failed_names} of a pytest junit file."""
    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError):
        return count_outcomes({})
    outcomes = {}
    for case in root.iter("testcase"):
        kinds = {child.tag for child in case}
        name = f"{case.get('classname')}::{case.get('name')}"
        outcomes[name] = next((k for k in ("failure", "error", "skipped") if k in kinds),
                              "passed")
    return count_outcomes(outcomes)


OUTCOME_KEYS = {"passed": "passed", "failure": "failures", "error": "errors",
                "skipped": "skipped"}


def count_outcomes(outcomes: dict) -> dict:
    """{tests, passed, failures, errors, skipped, failed_names, outcomes} of {test: outcome},
    outcome one of passed, failure, error, skipped."""
    out = {"tests": len(outcomes), "passed": 0, "failures": 0, "errors": 0, "skipped": 0,
           "failed_names": [], "outcomes": dict(outcomes)}
    for name, outcome in outcomes.items():
        out[OUTCOME_KEYS[outcome]] += 1
        if outcome in ("failure", "error"):
            out["failed_names"].append(name)
    return out


def verbose_counts(log: str) -> dict:
    """The same counts from `pytest -v` output ("tests/x.py::name PASSED [ 5%]" lines), for a
    run that was killed before it wrote its junit file."""
    words = {"PASSED": "passed", "FAILED": "failure", "ERROR": "error", "SKIPPED": "skipped"}
    found = re.findall(r"^tests/(\S+)\.py::(\S+) (PASSED|FAILED|ERROR|SKIPPED)", log,
                       re.MULTILINE)
    # Named as junit names them: the module's dotted path, then the test.
    return count_outcomes({f"tests.{module.replace('/', '.')}::{test}": words[outcome]
                           for module, test, outcome in found})


def tests_cuda(c: Campaign) -> StageResult:
    return _tests(c, "cuda")


def tests_triton(c: Campaign) -> StageResult:
    return _tests(c, "triton")


def _sanitize(c: Campaign, tool: str) -> StageResult:
    cases = [c.python, "-m", "bench.gpu_campaign.sanitize_cases"]
    log = f"sanitize_{tool}.log"
    env = dict(c.env, RECXLA_BACKEND="cuda")
    if c.dry_run:
        cmd = c.command(cases + ["--device", "cpu"], log, 120, env=env)
        calls = _count(r"(\d+) kernel calls", c.tail(log, 3))
        return StageResult("pass" if cmd.returncode == 0 else "fail",
                           f"{calls} calls run on CPU (the sanitizer needs a GPU)",
                           {"calls": calls})
    sanitizer = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not os.path.exists(sanitizer):
        return StageResult("fail", "compute-sanitizer not found")
    cmd = c.command([sanitizer, "--tool", tool, "--print-limit", "50", *cases], log, 150,
                    env=env)
    text = c.tail(log, 40)
    errors = _count(r"ERROR SUMMARY: (\d+) error", text)
    calls = _count(r"(\d+) kernel calls", text)
    if cmd.timed_out:
        return StageResult("timeout", f"{tool} did not finish ({calls} calls done)")
    ok = cmd.returncode == 0 and errors == 0 and calls > 0
    return StageResult("pass" if ok else "fail", f"{errors} errors over {calls} kernel calls",
                       {"errors": errors, "calls": calls})


def _count(pattern: str, text: str) -> int:
    found = re.findall(pattern, text)
    return int(found[-1]) if found else 0


def memcheck(c: Campaign) -> StageResult:
    return _sanitize(c, "memcheck")


def racecheck(c: Campaign) -> StageResult:
    return _sanitize(c, "racecheck")


def kernels(c: Campaign) -> StageResult:
    rows, choices, failed = [], [], []
    for module in c.options.get("kernel_modules") or KERNEL_MODULES:
        out = c.path(f"kernels_{module}.json")
        argv = [c.python, "-m", "bench.gpu_campaign.kernels", module, "--out", out]
        cmd = c.command(argv + (["--dry-run"] if c.dry_run else []), f"kernels_{module}.log",
                        DRY_RUN_BUDGET_S if c.dry_run else 50)
        if cmd.returncode != 0 or not os.path.exists(out):
            failed.append(f"{module} ({'timed out' if cmd.timed_out else 'exit ' + str(cmd.returncode)})")
            continue
        with open(out) as f:
            found = json.load(f)
        rows += found["rows"]
        choices += found["choices"]
    bad = [r for r in rows if r["check"].startswith("FAILED")]
    summary = f"{len(rows)} timings, {len(bad)} failed checks; winners: " + (
        ", ".join(f"{ch['family']} {ch['winner']}" for ch in choices) or "none")
    if failed:
        summary = f"modules that did not finish: {', '.join(failed)}; " + summary
    status = "pass" if not failed and not bad else "fail"
    return StageResult(status, summary, {"rows": rows, "choices": choices})


def trainer(c: Campaign) -> StageResult:
    out = c.path("trainer.json")
    argv = [c.python, "-m", "bench.gpu_campaign.trainer", "--out", out, "--work", c.work]
    cmd = c.command(argv + (["--dry-run"] if c.dry_run else []), "trainer.log",
                    DRY_RUN_BUDGET_S if c.dry_run else 240)
    if not os.path.exists(out):
        return StageResult("timeout" if cmd.timed_out else "fail",
                           f"no result (trainer.log): {c.tail('trainer.log', 2).strip()[-200:]}")
    with open(out) as f:
        data = json.load(f)
    trace = os.path.join(c.work, "kernel_trace.json.gz")
    if os.path.exists(trace):
        shutil.move(trace, os.path.join(c.out, "kernel_trace.json.gz"))
    return StageResult(data["status"], data["summary"], data)
