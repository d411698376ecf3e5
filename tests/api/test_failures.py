"""An error raised while a scan runs (forward or backward, any route) never kills the process.

Each route runs in a child interpreter (tests/api/failure_cases.py) that injects errors into the
body's forward and backward, checks that the next correct call still gives the loop's values
and gradients (no poisoned cache or state), and exits right after a failed backward: the
child must exit with code 0. torch 2.15 died at exit with SIGSEGV after an error in any node
of a backward through a remat scan (the nodes, holding our saved-tensor hooks, were stranded
in the engine's queue; core/drain.py's drain_at_exit). Both torches aborted (SIGABRT) when a
thread whose backward had failed ended just before the interpreter finalized (route "threads";
core/drain.py's drain_at_thread_end), and torch 2.11 and 2.15 aborted at exit when a thread that
had run a scan was still alive then (a daemon thread; on CUDA the engine's device threads,
where a remat backward's hooks run): the drain armed there ran a backward while the
interpreter finalized. Route "inference_threads": threads that ran scans forward only end there
too; the drain's own small backward aborted them on torch 2.12 (through torch's wrapper, which
leaves a Python object in a C++ thread_local there; the drain now calls the engine). Where torch
itself dies at that thread end (a plain backward, no scan, on 2.12), route "threads" skips saying so.
"""
import os
import subprocess
import sys

import _isolated
import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _torch_alone_dies_at_a_thread_end(env):
    """The "threads" route's exit race with torch alone (``_exit_race.plain_backward_in_a_thread``)."""
    plain = subprocess.run([sys.executable, "-c", "import _exit_race; _exit_race.plain_backward_in_a_thread()"],
                           capture_output=True, text=True, timeout=120, cwd=HERE, env=env)
    return plain.returncode != 0


def _xla():
    try:
        import torch_xla  # noqa: F401
    except ImportError:
        return pytest.mark.skip(reason="torch_xla is not installed: the XLA tests need the [xla] extra (torch 2.9)")
    return ()


@pytest.mark.parametrize("route", ["eager", "compiled", pytest.param("xla", marks=_xla()), "threads",
                                   "inference_threads"])
def test_an_error_in_a_scan_leaves_the_process_working_and_able_to_exit(route):
    """"threads": backwards that fail in other threads, whose ends meet the interpreter's exit
    (tests/api/_exit_race.py, imported first, makes that meeting certain)."""
    env = dict(os.environ, PYTHONPATH=_isolated.pythonpath(HERE),
               PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"))
    first = "import _exit_race; " if route.endswith("threads") else ""  # before anything registers an atexit handler
    out = subprocess.run([sys.executable, "-c", f"{first}import failure_cases; failure_cases.main({route!r})"],
                         capture_output=True, text=True, timeout=600, cwd=HERE, env=env)
    failures = out.stdout.rsplit("end\n", 1)[0].strip()
    assert out.stdout.endswith("end\n") and not failures, failures or out.stderr[-3000:]
    if out.returncode != 0 and route == "threads" and _torch_alone_dies_at_a_thread_end(env):
        pytest.skip(f"torch {torch.__version__} itself dies when a thread that ran any backward ends at exit "
                    "(a plain backward, no scan, dies there too): its backward leaves a Python "
                    "object in a C++ thread_local; torch 2.15 erases it")
    assert out.returncode == 0, (out.returncode, out.stderr[-3000:])
    assert "Fatal Python error" not in out.stderr and "Segmentation fault" not in out.stderr, out.stderr[-3000:]
