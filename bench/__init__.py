"""recxla's benchmarks: pytest-benchmark microbenchmarks (bench_<family>.py, shared helpers in
bench/common.py, figures in bench/results/) and the emulated-cluster benchmarks (bench/cluster).
Not part of the installed package, and outside pytest's default testpaths:

    .venv/bin/python -m pytest bench --benchmark-only --benchmark-columns=min,median,mean,rounds
"""
