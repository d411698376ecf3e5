"""Autograd work a failed backward leaves queued must be freed while Python still runs.

When a node raises in a backward, the engine stops its graph and the tasks still queued in
the ready queue of the thread that called ``backward`` (for CPU work: a C++ ``thread_local``
of that thread) stay there. They hold nodes and gradient tensors whose Python objects (our
saved-tensor hooks, custom ``autograd.Function``s, tensors Python created) need the GIL to
be freed. The next backward in that thread pops them first (a task whose graph is gone has
the highest priority) and frees them; without one they are freed

- in the main thread, after the interpreter is gone: torch 2.15 segfaulted at exit (the
  saved-tensor hooks' destructor); ``drain_at_exit`` runs one small backward at exit;
- in another thread, by the C++ ``thread_local`` destructors when the thread ends, after its
  Python state is gone: each takes the GIL, and if the interpreter starts finalizing in the
  meantime (the thread was joined just before exit: a ThreadPoolExecutor's workers at exit,
  ``t.join()`` as a script's last line) ``take_gil`` ends the thread with ``pthread_exit``
  inside a destructor: ``std::terminate``, SIGABRT (torch 2.9 and 2.15; a plain Python loop
  does it too). ``drain_at_thread_end`` runs one small backward when the thread's Python
  state is cleared, before those destructors; not when the finalizing interpreter clears it
  (a daemon thread alive at exit, or the engine's CUDA threads): a backward then aborted the
  process (``THPVariable_clear``'s use_count assert, torch 2.11 and 2.15).

No engine hook says that a backward failed, so the drains are armed where a scan runs: once
per process (exit) and once per thread (thread end), a dict lookup per call after that.
"""
import atexit
import sys
import threading

import torch

from .. import _compat

_draining = []
_thread = threading.local()


def _small_backward():
    """A backward of one element, run by the engine itself (``_compat.engine_backward``): through
    ``Tensor.backward`` torch 2.12 leaves a Python object in a C++ thread_local, which aborted
    threads that had run scans forward only (no backward of their own) as they ended at exit."""
    _compat.engine_backward(torch.ones(1, requires_grad=True).sum())


def drain_at_exit():
    """Registered once per process, when the first remat step is built (``op.loop.remat_step``:
    this engine's steps and scan_layers' per-layer torch.utils.checkpoint, whose hooks torch 2.15
    strands the same way)."""
    if not _draining:
        _draining.append(True)
        atexit.register(_small_backward)


class _SmallBackwardAtThreadEnd:
    """Held by a ``threading.local``: freed, and so run, while the thread's Python state is
    cleared (the thread is still current and holds the GIL), before its C++ thread_locals go."""

    __slots__ = ()

    def __del__(self):
        if sys.is_finalizing():  # a thread still alive at exit: its state is cleared by the
            return  # finalizing interpreter, where a backward aborted (THPVariable_clear's assert)
        try:
            _small_backward()
        except BaseException:  # noqa: BLE001  (nothing to report to at a thread's end)
            pass


def drain_at_thread_end():
    """Armed by every eager scan (``op.loop``): one small backward when this thread ends.
    The main thread is ``drain_at_exit``'s (its thread state is cleared during finalization)."""
    if "armed" in _thread.__dict__:
        return
    _thread.armed = _SmallBackwardAtThreadEnd() if _ends_before_exit(threading.current_thread()) else None


def _ends_before_exit(thread):
    """A thread Python started, other than the main one. Not the autograd engine's device
    threads (CUDA: the backward's saved-tensor hooks run there), which C++ started: they
    live until the process ends, and their Python state is cleared only by the finalizing
    interpreter."""
    return thread is not threading.main_thread() and not isinstance(thread, threading._DummyThread)
