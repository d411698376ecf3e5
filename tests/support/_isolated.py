"""Run test checks in a long-lived child interpreter, so that a native crash (an XLA abort,
a segfault) fails only the case that was running instead of killing the whole pytest run.

    call("test_model_zoo", "check_xla", "kalman")   # raises AssertionError on failure or crash
    call("spmd_cases", "check_cumsum", env=SPMD)        # a child of its own, started with env

The child imports torch (and torch_xla) once; after a crash the next call starts a new one.
``env`` is set before the child starts (what torch_xla reads once, at start:
CPU_NUM_DEVICES); one child is kept per distinct env. ``SPMD`` starts one on 4
virtual CPU devices in SPMD mode (``torch_xla.runtime.use_spmd()`` before any test).
"""
import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile

MARK = "@@isolated-result@@ "
HERE = os.path.dirname(os.path.abspath(__file__))  # tests/support
TESTS = os.path.dirname(HERE)
REPO = os.path.dirname(TESTS)
# tests/ (conftest) and every folder of it, as pyproject.toml's pythonpath puts them on pytest's path: test
# modules import conftest, these helpers and one another by bare name, in pytest and in child interpreters
TEST_PATH = [TESTS] + sorted(e.path for e in os.scandir(TESTS) if e.is_dir() and not e.name.startswith(("_", ".")))
SPMD = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", "ISOLATED_USE_SPMD": "1"}
_children = {}  # the env's items -> (process, stderr log)


def pythonpath(*first):
    """PYTHONPATH for a child interpreter that imports test modules by bare name: ``first``, every
    test folder (``TEST_PATH``), the repository, then the caller's own PYTHONPATH."""
    return os.pathsep.join([*first, *TEST_PATH, REPO, os.environ.get("PYTHONPATH", "")])


def _start(extra):
    log = tempfile.TemporaryFile(mode="w+")
    env = dict(os.environ, PYTHONPATH=pythonpath())
    env.update(extra)
    proc = subprocess.Popen([sys.executable, "-u", "-c", "import _isolated; _isolated.serve()"], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
    _children[tuple(sorted(extra.items()))] = (proc, log)
    return proc, log


def call(module, func, *args, env=None):
    """``module.func(*args)`` in the child for ``env``; AssertionError on failure or crash."""
    child = _children.get(tuple(sorted((env or {}).items())))
    proc, log = child if child is not None and child[0].poll() is None else _start(env or {})
    proc.stdin.write(json.dumps([module, func, args]) + "\n")
    proc.stdin.flush()
    for line in proc.stdout:
        if line.startswith(MARK):
            error = json.loads(line[len(MARK):])
            if error:
                raise AssertionError(error)
            return
    code = proc.wait()
    log.seek(0)
    how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    raise AssertionError(f"{module}.{func}{args} crashed the interpreter ({how}); its stderr ends:\n"
                         + log.read()[-6000:])


def serve():
    import importlib
    import traceback

    if os.environ.get("ISOLATED_USE_SPMD") == "1":  # before any XLA tensor exists
        import torch_xla.runtime as xr
        xr.use_spmd()
    import conftest  # noqa: F401  (PJRT_DEVICE, torch_xla started before any backward)
    for line in sys.stdin:
        module, func, args = json.loads(line)
        try:
            getattr(importlib.import_module(module), func)(*args)
            error = None
        except BaseException as e:  # noqa: BLE001  (the message first, then where)
            error = f"{type(e).__name__}: {e}\n\n{traceback.format_exc()[-8000:]}"
        sys.stdout.write(MARK + json.dumps(error) + "\n")
        sys.stdout.flush()


@atexit.register
def _stop():
    for proc, _ in _children.values():
        if proc.poll() is None:
            proc.stdin.close()
            proc.wait(timeout=60)
