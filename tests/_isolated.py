"""Run test checks in a long-lived child interpreter, so that a native crash (an XLA abort,
a segfault) fails only the case that was running instead of killing the whole pytest run.

    call("test_model_zoo", "check_xla", "kalman")   # raises AssertionError on failure or crash

The child imports torch (and torch_xla) once; after a crash the next call starts a new one.
"""
import atexit
import json
import os
import subprocess
import sys
import tempfile

MARK = "@@isolated-result@@ "
HERE = os.path.dirname(os.path.abspath(__file__))
_child = None


def _start():
    global _child
    log = tempfile.TemporaryFile(mode="w+")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-u", "-c", "import _isolated; _isolated.serve()"], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
    _child = (proc, log)
    return _child


def call(module, func, *args):
    proc, log = _child if _child is not None and _child[0].poll() is None else _start()
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
    raise AssertionError(f"{module}.{func}{args} crashed the interpreter (exit code {code}); its stderr ends:\n"
                         + log.read()[-6000:])


def serve():
    import importlib
    import traceback

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
    if _child is not None and _child[0].poll() is None:
        _child[0].stdin.close()
        _child[0].wait(timeout=60)
