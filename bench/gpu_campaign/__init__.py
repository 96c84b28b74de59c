"""recxla's GPU campaign: one command that builds, tests, sanitizes and times every GPU path on a
GPU machine and writes its own report (`make gpu-campaign`, docs/gpu.md).

    python3 -m bench.gpu_campaign                 # on the GPU machine, from the project root
    python3 -m bench.gpu_campaign --dry-run       # here: every stage that needs no GPU

Stages (run.py runs them, stages.py defines them): env, build, tests (CUDA and Triton backends),
sanitize (compute-sanitizer memcheck and racecheck), kernels (each op family's variants checked
against the reference, then timed against plain PyTorch, torch.compile and a device copy),
trainer (one GPU, pipelined against sequential, a torch.profiler trace and its stream overlap),
report (bench/results/gpu.md and gpu.json). Each stage has a time budget, a failing stage does
not stop the others, and a summary table is printed last.
"""
