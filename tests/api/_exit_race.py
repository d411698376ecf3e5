"""Makes the exit race of a thread's stranded autograd tasks certain (tests/api/failure_cases.py "threads").

A backward that fails in a thread leaves tasks in that thread's C++ thread_local ready queue;
they were freed by its thread_local destructors after the thread's Python state was gone, and
each takes the GIL: a thread that ended just before the interpreter finalized died there
(take_gil's pthread_exit inside a destructor: SIGABRT), about 2 runs in 10. Imported before
anything registers an atexit handler, this module holds each thread's C++ destructors
(``hold_thread_end``: one more, registered after the ready queue's, so run before it) until
the last atexit handlers run, which release them and then keep the GIL for a moment without
running bytecode: the released threads wait for the GIL and find the interpreter finalizing.
Linux/glibc only (``__cxa_thread_atexit_impl``); elsewhere it does nothing.
"""
import atexit
import ctypes
import threading

_MAX_THREADS = 64
_held = threading.local()
try:
    _libc, _py_libc = ctypes.CDLL(None), ctypes.PyDLL(None)  # PyDLL: the call keeps the GIL
    _at_thread_exit = _libc.__cxa_thread_atexit_impl
    _at_thread_exit.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    _sem = ctypes.create_string_buffer(64)  # a sem_t
    _libc.sem_init(_sem, 0, 0)
except (OSError, AttributeError):
    _at_thread_exit = None

if _at_thread_exit is not None:
    atexit.register(sum, range(10_000_000))  # registered first, run last: the GIL held, no bytecode
    for _ in range(_MAX_THREADS):
        atexit.register(_py_libc.sem_post, _sem)


def hold_thread_end():
    """Call in a thread after its first backward: its C++ thread_locals wait for the exit."""
    if _at_thread_exit is None or getattr(_held, "done", False):
        return
    _held.done = True
    _at_thread_exit(ctypes.cast(_libc.sem_wait, ctypes.c_void_p), ctypes.addressof(_sem), None)


def plain_backward_in_a_thread():
    """torch alone, no scan: a thread that ran one backward ends at exit's doorstep. torch 2.12 aborts
    here (SIGABRT; seen 2026-12-01): its ``_engine_run_backward`` leaves a Python object (the stashed
    context, then None) in a C++ thread_local that is freed, taking the GIL, after the thread's Python
    state. torch 2.9 stashes nothing there; 2.15 erases it (``_remove_obj_from_tls``)."""
    import torch

    def work():
        torch.ones(3, requires_grad=True).sum().backward()
        hold_thread_end()

    t = threading.Thread(target=work)
    t.start()
    t.join()
