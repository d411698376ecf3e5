"""This package's own traces: serialized across threads, known on the thread that runs them, and
the FX sources they leave bounded.

make_fx keeps its tracer in a process-wide global, so two threads tracing at once would record
into one graph: ``tracing_lock`` serializes our traces, and ``under_make_fx`` counts a make_fx
trace only when it is this thread's. Every GraphModule compiles its code under a fresh
``<eval_with_key>.N`` entry of FX's source cache that torch never drops; a scan traced on every
call would grow them without bound, so only the newest few hundred of ours are kept (they serve
tracebacks only; the compiled code does not need them). torch's side (the tracer global, the
proxy mode, the source cache) is ``_compat.tracing``'s adapters.
"""
import collections
import contextlib
import itertools
import linecache
import threading

from .. import _compat

_TRACE_LOCK = threading.RLock()
_LOCAL = threading.local()  # .depth: how many of our traces are open on this thread
_MAX_OUR_SOURCES = 512
_our_sources = collections.deque()


def under_make_fx():
    """True while a make_fx trace runs on THIS thread (so subgraphs must re-enter it).

    make_fx keeps its tracer in a process-wide global; another thread's trace
    must not count, so the tracer only counts with a proxy mode on this
    thread's stack or inside one of our own traces here (``tracing_lock``).
    """
    if _compat.tracing.make_fx_tracer() is None:
        return False
    return _local_depth() > 0 or _compat.tracing.proxy_mode() is not None


def inside_our_trace():
    """True inside one of this package's own traces on this thread (a scan body's)."""
    return _local_depth() > 0


def _local_depth():
    return getattr(_LOCAL, "depth", 0)


@contextlib.contextmanager
def tracing_lock():
    """Serializes this package's traces across threads (make_fx's tracer is a
    process-wide global) and bounds the FX sources they leave in linecache to the
    newest ``_MAX_OUR_SOURCES``."""
    with _TRACE_LOCK:
        depth = _local_depth()
        _LOCAL.depth = depth + 1
        before = len(_compat.tracing.fx_source_cache()) if depth == 0 else None
        try:
            yield
        finally:
            _LOCAL.depth = depth
            if before is not None:
                _forget_old_sources(before)


def _forget_old_sources(before):
    cache = _compat.tracing.fx_source_cache()
    new = len(cache) - before
    _our_sources.extend(reversed(list(itertools.islice(reversed(cache), max(new, 0)))))
    while len(_our_sources) > _MAX_OUR_SOURCES:
        key = _our_sources.popleft()
        cache.pop(key, None)
        linecache.cache.pop(key, None)
