"""How a loop run as one C++ kernel (``loop_kernel``) is built and loaded: inductor's
``cpp_pybinding`` build (its source file, compile flags, precompiled header, cache key, lock and
loader) with these differences, all for the first call of a compiled scan (issue 62; the tanh RNN's
forward at T=256 spent ~0.9 s of a ~1.5 s first call building this one kernel):

- the link names ``libtorch`` (kept as a needed library whatever the toolchain's ``--as-needed``
  says) instead of ``libtorch`` and ``libtorch_cpu``: to link against a library, ld reads all of
  its dynamic symbols, and libtorch_cpu.so (~440 MB) made ~0.25-0.4 s of the build. Loading does
  not change: the kernel's undefined symbols (``sgemm_``, Sleef's ``tanh``) are looked up in the
  libraries it needs and theirs, and libtorch.so needs libtorch_cpu.so, the one torch has
  loaded: the same functions as before. The compile options (and the cache key) are
  inductor's. The library is loaded once right after the link (every symbol bound at once):
  where it does not load, it is linked again with inductor's own command, with one
  ``KernelLinkWarning``. Counted as ``loop_kernel_link``
  (``pass_counts``): applied, skipped (a command without those two libraries in that order, as
  on macOS or Windows), failed (linked again).
- its Python binding (inductor's, after the kernel in the same file) is compiled without
  ``<sstream>``: the binding reads one decimal address from an environment variable, which
  torch 2.9 parses with ``std::istringstream`` (torch 2.15 with ``std::strtoull``, the header still
  included), and parsing ``<sstream>`` made ~0.06 s (~8%) of this kernel's build. The file is
  written next to inductor's (``.main.cpp`` -> ``.main.scan.cpp``), the cache key is inductor's.
  Counted as ``loop_kernel_binding``: applied, skipped (a binding not as expected, or a file that
  reads a stream anywhere else: built as inductor wrote it), failed (that file did not build and
  inductor's did: built from inductor's, with one ``KernelBindingWarning``).
- it is compiled with ``kernel_header``'s precompiled header, inductor's ``cpp_prefix.h`` with the
  template instantiations that GCC leaves pending at the end of a header already done (each file
  including inductor's did them: ~0.3 s of CPU, the kernel's object file the same byte for byte),
  where that header is built (in the background, the first time a kernel asks for it). Counted as
  ``loop_kernel_header``: applied, skipped (not built yet, not GCC, failed before, or turned off by
  ``passes_off("loop_kernel_header")``), failed (the
  command did not build with it and did with inductor's header: built so, with one
  ``KernelHeaderWarning``, and that header not used again).
- the wrapper module does not wait for it when it loads: the build runs on inductor's compile
  thread pool while the compile goes on (AOTAutograd's wrappers, Dynamo's guards, a backward
  graph); the kernel's first call waits for it, then rebinds the module's name to the kernel
  (later calls go straight to it). A build error is raised by that first call.
"""
import ctypes
import os
import time
import warnings

from ... import _compat
from . import kernel_header, pipeline


class KernelLinkWarning(RuntimeWarning):
    """The loop kernel, linked without libtorch_cpu, did not load: it was linked again as
    inductor links its kernels (right, the first call slower)."""


class KernelHeaderWarning(RuntimeWarning):
    """The loop kernel did not build with our precompiled header (``kernel_header``) and did with
    inductor's: built with inductor's (right, the first call slower); ours is not used again."""


class KernelBindingWarning(RuntimeWarning):
    """The loop kernel's file with its binding's ``<sstream>`` left out did not build: it was built
    from the file inductor wrote (right, the first call slower)."""


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


_SSTREAM = "#include <sstream>"
_ISTRINGSTREAM = ("std::istringstream iss(str_addr);", "uintptr_t addr = 0;", "iss >> addr;")
_STRTOULL = "uintptr_t addr = std::strtoull(str_addr, nullptr, 10);"  # ``iss >> addr``'s value: 0 where no digits


def without_sstream(text):
    """``text`` (a kernel's file: its source, then inductor's Python binding) with the binding's
    ``#include <sstream>`` left out and torch 2.9's ``std::istringstream`` parse of the address
    written as ``std::strtoull`` (torch 2.15's); None where the include is not there exactly once
    or where a stream is read anywhere else."""
    lines = text.split("\n")
    at = [i for i, line in enumerate(lines) if line.strip() == _SSTREAM]
    if len(at) != 1:
        return None
    del lines[at[0]]
    stripped = [line.strip() for line in lines]
    for i in range(len(lines) - len(_ISTRINGSTREAM) + 1):
        if tuple(stripped[i:i + len(_ISTRINGSTREAM)]) == _ISTRINGSTREAM:
            indent = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
            lines[i:i + len(_ISTRINGSTREAM)] = [indent + _STRTOULL]
            break
    out = "\n".join(lines)
    return None if "stream" in out else out


def lighter_binding(command):
    """``command`` compiling ``<name>.main.scan.cpp`` (written here: its ``.main.cpp`` as
    ``without_sstream`` gives it) instead of ``<name>.main.cpp``; None where the command names no
    such file once or ``without_sstream`` gives None."""
    parts = command.split(" ")
    sources = [i for i, part in enumerate(parts) if part.endswith(".main.cpp")]
    if len(sources) != 1 or not os.path.isfile(parts[sources[0]]):
        return None
    path = parts[sources[0]]
    with open(path) as f:
        text = without_sstream(f.read())
    if text is None:
        return None
    light = path[:-len(".cpp")] + ".scan.cpp"
    with open(light, "w") as f:
        f.write(text)
    parts[sources[0]] = light
    return " ".join(parts)


def _build(command, run, target):
    """One build of the kernel (``_compat.inductor.build_cpp_pybinding``'s ``build``): its file
    with the lighter binding, else (or where that did not build but inductor's does) inductor's;
    each command run with our precompiled header where there is one (``_with_own_header``)."""
    run = _with_own_header(run)
    lighter = lighter_binding(command)
    if lighter is None:
        pipeline.record("loop_kernel_binding", "skipped")
        return _linked(command, run, target)
    # inductor's file: raises the kernel's own error where that does not build either
    return _applied_or_fallen_back(
        "loop_kernel_binding", lambda: _linked(lighter, run, target), lambda: _linked(command, run, target),
        KernelBindingWarning, "the loop kernel without <sstream> in its binding did not build ({error}); "
        "built as inductor wrote it. Please report it with your torch version.")


def _applied_or_fallen_back(name, attempt, fallback, warning, message):
    """``attempt()``, counted ``applied`` under ``name``; where it raises, ``fallback()`` (whose own
    error is the one raised where it fails too), counted ``failed``, with one ``warning``
    (``message`` formatted with the attempt's ``error``)."""
    try:
        result = attempt()
    except Exception as error:
        result = fallback()
        pipeline.record(name, "failed")
        warnings.warn("torch_scan_hop: " + message.format(error=error), warning, stacklevel=3)
        return result
    pipeline.record(name, "applied")
    return result


def prepare_header():
    """Build the loop kernel's precompiled header (``kernel_header``) now and wait for it: a tiny
    kernel built as loop kernels are asks for it (it is built with inductor's header meanwhile).
    Once per machine, compiler, flags and torch version, as inductor's own header: for a benchmark's
    warm-up or a container image's build step, so that no first compiled call of a scan is the one
    that starts it. Returns whether the header is there to be used (False: not GCC, or a GCC that
    did not build it; kernels then build with inductor's header)."""
    nonce = f"{os.getpid()}-{time.time_ns()}"  # a source never built before: its build is what asks
    source = f'#include <torch/csrc/inductor/cpp_prefix.h>\n// {nonce}\nextern "C" void kernel(const int64_t n) {{}}\n'
    kernel = _compat.inductor.build_cpp_pybinding(["const int64_t"], source, _build)()
    kernel(0)
    return kernel_header.ready()


def _with_own_header(run):
    """``run`` where each command includes ``kernel_header``'s header instead of inductor's when
    it is built, and runs again as it is where it does not build that way but does as it is (a
    command that fails both ways raises its own error)."""
    def run_with_own_header(command):
        ours = None if pipeline.is_off("loop_kernel_header") else kernel_header.with_own_header(command)
        if ours is None:
            pipeline.record("loop_kernel_header", "skipped")
            return run(command)

        def with_inductors_header():
            result = run(command)
            kernel_header.forget(ours)
            return result
        return _applied_or_fallen_back(
            "loop_kernel_header", lambda: run(ours), with_inductors_header, KernelHeaderWarning,
            "the loop kernel did not build with its precompiled header ({error}); built with inductor's. "
            "Please report it with your compiler and torch versions.")
    return run_with_own_header


def _linked(command, run, target):
    """``command`` run linked against libtorch only (``relinked``), or as it is where it cannot be."""
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
