"""Trainer ranks forked from an interpreter that has already imported the trainer.

A rank of `python -m recxla.train` spends about 9 s of CPU importing torch, TorchRec and the
trainer before its first step, more than the few steps a test runs; with 2 ranks on 2 cores and
about 50 launches that was most of the suite's time. `WarmRank` instead forks the rank from
the test run's forkserver, which has imported those modules once
(tests/preloaded_forkserver.py): the rank then runs the same `recxla.train` main module, with
its own arguments, environment, working directory and log, and exits as that process would (its
exit code, or minus the signal that ended it).

What a fork cannot give stays with a fresh interpreter: an import-time error and the console
entry point (the tests that start the trainer with torchrun or `python -m recxla.train`), an
environment variable that only a starting process reads (GLIBC_TUNABLES) and a GPU rank
(`start_ranks` in tests/test_train_cli.py starts those afresh).
"""

import atexit
import os
import runpy
import subprocess
import sys
from typing import Dict, List, Optional, Sequence

import recxla.train

import preloaded_forkserver

_MAIN = os.path.join(os.path.dirname(recxla.train.__file__), "__main__.py")


def _run_trainer(args: List[str], env: Dict[str, str], cwd: str, log: str) -> None:
    """The forked rank: `python -m recxla.train ARGS` with `env` in `cwd`, output to `log`."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [_MAIN, *args]
    try:
        runpy.run_module("recxla.train", run_name="__main__", alter_sys=True)
    finally:
        # The forkserver's child leaves by os._exit: run what an interpreter runs at its exit.
        atexit._run_exitfuncs()


class WarmRank:
    """The subprocess.Popen calls the trainer tests make, on a forked rank."""

    def __init__(self, args: Sequence[str], env: Dict[str, str], cwd: str, log: str):
        self.args = ["python", "-m", "recxla.train", *args]
        self._process = preloaded_forkserver.context().Process(
            target=_run_trainer, args=(list(args), dict(env), cwd, log))
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> Optional[int]:
        return self._process.exitcode

    def poll(self) -> Optional[int]:
        return self._process.exitcode

    def wait(self, timeout: Optional[float] = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self._process.kill()
