"""How a loop run as one C++ kernel (``loop_kernel``) is built and loaded: inductor's
``cpp_pybinding`` build (its source file, compile flags, precompiled header, cache key, lock and
loader) with two differences, both for the first call of a compiled scan (issue 62; the tanh RNN's
forward at T=256 spent ~0.9 s of a ~1.5 s first call building this one kernel):

- the link names ``libtorch`` (kept as a needed library whatever the toolchain's ``--as-needed``
  says) instead of ``libtorch`` and ``libtorch_cpu``: to link against a library, ld reads all of
  its dynamic symbols, and libtorch_cpu.so (~440 MB) made ~0.25-0.4 s of the build. Loading does
  not change: the kernel's undefined symbols (``sgemm_``, Sleef's ``tanh``) are looked up in the
  libraries it needs and theirs, and libtorch.so needs libtorch_cpu.so, the one torch has
  loaded: the same functions as before. The compile command (and so the precompiled header
  inductor's kernels share, and the cache key) is inductor's. The library is loaded once right
  after the link (every symbol bound at once): where it does not load, it is linked again with
  inductor's own command, with one ``KernelLinkWarning``. Counted as ``loop_kernel_link``
  (``pass_counts``): applied, skipped (a command without those two libraries in that order, as
  on macOS or Windows), failed (linked again).
- the wrapper module does not wait for it when it loads: the build runs on inductor's compile
  thread pool while the compile goes on (AOTAutograd's wrappers, Dynamo's guards, a backward
  graph); the kernel's first call waits for it, then rebinds the module's name to the kernel
  (later calls go straight to it). A build error is raised by that first call.
"""
import ctypes
import os
import warnings

from ... import _compat
from . import pipeline


class KernelLinkWarning(RuntimeWarning):
    """The loop kernel, linked without libtorch_cpu, did not load: it was linked again as
    inductor links its kernels (right, the first call slower)."""


def deferred_kernel(scope, name, argtypes, source):
    """What the wrapper module binds ``name`` to (its ``globals()``: ``scope``): the kernel
    ``source`` (``extern "C" void kernel(...)`` of ``argtypes``), being built."""
    return _Deferred(scope, name, _compat.inductor.build_cpp_pybinding(argtypes, source, _build))


class _Deferred:
    """A kernel being built: its first call waits for it and puts the kernel in its place."""

    __slots__ = ("scope", "name", "result")

    def __init__(self, scope, name, result):
        self.scope, self.name, self.result = scope, name, result

    def __call__(self, *args):
        kernel = self.result()
        self.scope[self.name] = kernel
        return kernel(*args)


def relinked(command):
    """``command`` (inductor's compile-and-link command line) linked against libtorch only, or
    None where it is not a link naming ``-ltorch`` then ``-ltorch_cpu``."""
    parts = command.split(" ")
    if "-shared" not in parts or "-c" in parts or parts.count("-ltorch") != 1 or parts.count("-ltorch_cpu") != 1:
        return None
    at = parts.index("-ltorch")
    if parts.index("-ltorch_cpu") < at:
        return None
    parts.remove("-ltorch_cpu")
    parts[at:at + 1] = ["-Wl,--push-state,--no-as-needed", "-ltorch", "-Wl,--pop-state"]
    return " ".join(parts)


def _build(command, run, target):
    """One build of the kernel (``_compat.inductor.build_cpp_pybinding``'s ``build``)."""
    light = relinked(command)
    if light is None:
        pipeline.record("loop_kernel_link", "skipped")
        return run(command)
    run(light)
    reason = _load_error(target)
    if reason is None:
        pipeline.record("loop_kernel_link", "applied")
        return None
    os.remove(target)
    pipeline.record("loop_kernel_link", "failed")
    warnings.warn(f"torch_scan_hop: the loop kernel linked against libtorch only did not load ({reason}); "
                  "linked again as inductor links its kernels. Please report it with your torch version.",
                  KernelLinkWarning, stacklevel=2)
    return run(command)


def _load_error(path):
    """Why the library ``path`` does not load with every symbol bound, or None where it loads."""
    try:
        ctypes.CDLL(path)  # RTLD_NOW: an unresolved symbol fails here, not at a later call
    except OSError as error:
        return str(error)
    return None
