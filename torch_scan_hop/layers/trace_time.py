"""Dynamo: a question answered in plain Python while tracing, its answer a constant of the trace.

Some choices a stack makes before its scan need Python run on the values the traced code holds:
whether a stack's layer kinds trace to one graph (``one_code``) is told by make_fx tracing each
kind's code. Traced by Dynamo, that Python would be speculated op by op (Dynamo's trace of one
layer costs more than make_fx's of all of them), and Dynamo speculates the ``torch.cond`` the
answer would spare. So under Dynamo the question is the call of a tiny HigherOrderOperator whose
tracker runs the function on the real modules and the tensors' fake example values and hands
back the answer as a constant: no op of it reaches the graph.

Where the tracker cannot be installed, a value has no stand-in (a symbolic size, an object
built while tracing), or the function raises, the answer is the caller's ``default``: the
traced code then takes the general path (the cond), slower but right. A ScanError (the user's
error, e.g. a layer that differs from its kind in an attribute the code reads) is raised as
torch.compile shows our errors. Counted (``counts()``).
"""
import collections
import warnings

import torch

from .. import _compat
from .._compat import versions
from ..core.trees import ScanError
from ..op.compile_errors import compile_error

_NAME = "torch_scan_hop_at_trace_time"
_PLAIN = (bool, int, str, type(None))
_counts = collections.Counter()
_installed = [False]


class AtTraceTimeOp(_compat.HigherOrderOperator):
    """``at_trace_time(fn, default, *args)``: ``fn(*args)``. Called only under Dynamo, whose
    tracker answers; called eagerly it is the call itself."""

    def __init__(self):
        super().__init__(_NAME)

    def __call__(self, fn, default, *args):
        return fn(*args)


_at_trace_time = AtTraceTimeOp()


def counts():
    """Questions asked under Dynamo: ``answered`` (run at trace time), ``default`` (not)."""
    return dict(_counts)


def ask(fn, default, *args):
    """``fn(*args)`` under Dynamo, run at trace time on the args' Python values (tensors as
    fakes); ``default`` where it cannot be. ``fn``: a module-level function returning a bool,
    an int, a str, None or a tuple of them, reading its tensors' metadata only (no values: they are fakes).

    Returns:
        The answer, a constant of the trace (``default`` outside Dynamo: ask it directly there).
    """
    if not _installed[0] or not _compat.is_dynamo_compiling():
        return default
    return _at_trace_time(fn, default, *args)


def _answer(fn, default, values):
    try:
        answer = fn(*values)
    except ScanError as e:  # the user's error, told as the traced code would tell it
        raise compile_error(e.args[0]) from e
    except Exception as e:  # noqa: BLE001 -- the general path runs, and raises what applies to it
        _counts["default"] += 1
        _counts[f"raised {type(e).__name__}"] += 1
        return default
    if not _is_plain(answer):
        raise TypeError(f"torch_scan_hop: {fn.__name__} answered {answer!r} at trace time; a constant of "
                        "the trace is a bool, an int, a str, None or a tuple of them")
    _counts["answered"] += 1
    return answer


def _is_plain(answer):
    return isinstance(answer, _PLAIN) or (isinstance(answer, tuple) and all(_is_plain(a) for a in answer))


def _make_tracker_class():
    from .._compat import dynamo as dyn

    class AtTraceTimeVariable(dyn.hop_tracker_base(_NAME)):
        def _call_function(self, tx, args, kwargs):
            args = dyn.realize_all(list(args))
            default = args[1].as_python_constant()
            modules = []
            try:
                fn, values = dyn.python_value(args[0], tx), [dyn.python_value(a, tx, modules) for a in args[2:]]
                changed = dyn.modified_in_trace(tx, [o for module in modules for o in _compat.nn.tree_objects(module)])
            except (NotImplementedError, AttributeError, TypeError, KeyError):
                changed = True
            if changed:  # no stand-in, or the frame changed a module: the real objects lag the trace
                _counts["default"] += 1
                return dyn.constant(default)
            return dyn.constant(_answer(fn, default, values))

    return AtTraceTimeVariable


def install():
    """Register the tracker for our op's name (idempotent)."""
    _installed[0] = install_tracker(_NAME, _make_tracker_class, "of questions asked while tracing",
                                    "a stack of several layer kinds then runs a cond between them")


def install_tracker(name, make_class, what, otherwise):
    """Register the tracker ``make_class()`` for the HOP ``name`` (idempotent): whether it is.
    A torch whose Dynamo internals moved gets a warning naming the tracker (``what``) and what
    torch.compile then does (``otherwise``)."""
    from .._compat.dynamo import tracker_registry

    registry = tracker_registry()
    try:
        registry.setdefault(name, make_class())
    except (AttributeError, TypeError, ImportError) as e:  # a torch whose Dynamo internals moved
        warnings.warn(f"torch_scan_hop supports {versions.supported_range()}; on torch {torch.__version__} the "
                      f"tracker {what} could not be installed ({e}): under torch.compile {otherwise}.")
        return False
    return True


def installed():
    """Whether Dynamo takes our tracker (else ``ask`` answers its default)."""
    return _installed[0]
