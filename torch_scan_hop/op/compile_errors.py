"""The errors of a failed capture of scan by torch.compile, as ScanErrors that say what failed.

Dynamo reports most failures inside a HOP's body alike (a graph break); the tracker
(``op.dynamo``) hands each one here, which tells apart an exception the body itself
raised, a graph break, a data dependence and a ScanError of our own checks, and makes
the one error Dynamo lets through unchanged (``compile_error``). ``surface`` is the way
out of Dynamo for the front ends' own checks. A failed capture renders tensors, whose repr
must not leave functorch's keys excluded (``tensor_repr_releases_its_guard``).
"""
import contextlib
import re

import torch

from .. import _compat
from ..core.trees import ScanError
from ..trace.graph import data_dependence_message

GRAPH_BREAK = ("torch_scan_hop.scan: the body fn must be captured whole by torch.compile "
               "(no graph breaks inside the scanned function)")


_FAKE_RUN = re.compile(r"Dynamo failed to run FX node with fake tensors: call_function (.+?)\(\*.*\): "
                       r"got (\w+)\((['\"])(.*)\3\)\s*$", re.DOTALL)
NOT_A_GRAPH_BREAK = ("(an error of the body itself, not a graph break: run eagerly on those shapes, the body "
                      "or its backward raises it too)")


def _chain(e):
    """``e`` and the exceptions it was raised from (its cause, else its context), outermost first."""
    seen = []
    while e is not None and all(e is not s for s in seen):
        seen.append(e)
        e = e.__cause__ or e.__context__
    return seen


def _body_raised(chain, tx):
    """The message for a capture that failed because the body itself raised: a ``raise`` in its
    code, or one of its ops failing on fake tensors of a step's shapes (``c @ w`` of mismatched
    shapes), or its gradient failing to trace. Dynamo reports these as graph breaks, which they
    are not (torch 2.9 also drops the raised exception's arguments). None for anything else: a
    graph break, a data dependence, our own ScanError (each has its own message). ``chain``: the
    failed capture's exception and those it was raised from (``_chain``)."""
    if not any(_wraps_a_raised_error(c) for c in chain) or any(
            isinstance(c, ScanError) or _compat.is_data_dependence_error(c) for c in chain):
        return None
    plain = [c for c in chain if not _compat.dynamo.is_dynamo_exception(c)]
    if plain:  # the op's own error, kept as the cause of Dynamo's wrappers
        kind, text = type(plain[-1]), str(plain[-1])
    else:  # simulated by Dynamo: the exception lives on the translator's stack
        raised = _raised_exception(tx)
        if raised is None:
            return None
        kind, args = raised
        text = str(args[0]) if len(args) == 1 else str(args) if args else ""
    if isinstance(kind, type) and issubclass(kind, ScanError):
        return text
    fake_run = _FAKE_RUN.match(text)
    if fake_run:  # 2.15: the op's error only as text inside Dynamo's
        target, name, _, inner = fake_run.groups()
        text, kind = f"{inner} (in {target})", name
    name = kind if isinstance(kind, str) else kind.__name__
    if name == "AssertionError":  # more likely an internal check of torch's (or ours) than the body's
        return None
    return (f"torch_scan_hop.scan: the body fn raised {name} when Dynamo (torch.compile, torch.export) "
            f"traced it on fake tensors of one step's shapes {NOT_A_GRAPH_BREAK}{': ' + text if text else '.'}")


def _scan_error_within(chain):
    """A ScanError in an exception's ``chain`` (Dynamo re-raises an error of an op's fake run as a
    TorchRuntimeError whose cause is the original)."""
    return next((c for c in chain if isinstance(c, ScanError)), None)



def _failed_assert(chain, unsupported):
    """Dynamo's report of an ``assert`` in the body whose condition it found False (a constant:
    ``assert x.shape[0] == 5``), which inside a HOP's body it cannot leave to run eagerly. Its
    name says "Data-dependent"; printing the partial subgraph for it can then fail itself (an
    IndentationError from an empty graph: InternalTorchDynamoError, torch 2.9 and 2.15)."""
    return next((c for c in chain if isinstance(c, unsupported)
                 and str(getattr(c, "msg", None) or c).startswith("Data-dependent assertion failed")), None)


def capture_failure(e, tx, uncaptured, unsupported):
    """What to raise for ``e``, raised while the tracker captured a scan: a ScanError naming what
    failed, or ``e`` itself (an error of Dynamo's or torch's that is none of ours)."""
    chain = _chain(e)
    failed = _failed_assert(chain, unsupported)
    if failed is not None:
        return compile_error("torch_scan_hop.scan: an assert in the body fn failed when Dynamo (torch.compile, "
                             f"torch.export) traced it on fake tensors of one step's shapes {NOT_A_GRAPH_BREAK}: "
                             "AssertionError.",
                             getattr(failed, "real_stack", None))
    raised = _body_raised(chain, tx)
    if raised is not None:  # the body's own error (or its op's), not a graph break
        return compile_error(raised, getattr(e, "real_stack", None))
    if isinstance(e, uncaptured):  # a graph break in the body, e.g. `if c.sum() > 0:`
        return as_scan_error(e)
    if isinstance(e, unsupported):  # the same message as torch 2.9's hard error
        return compile_error(_with_hints(f"{GRAPH_BREAK} Got {_graph_break_message(e)}", e),
                             getattr(e, "real_stack", None))
    ours = _scan_error_within(chain)  # raised by our op's fake run: Dynamo wraps it
    if ours is not None:
        return compile_error(str(ours))
    if not _compat.is_data_dependence_error(e):
        return e
    return compile_error(data_dependence_message(e))


def _graph_break_message(e):
    """What broke the graph: Dynamo's message, or for an exception the body
    raised while Dynamo ran it on fake tensors (torch 2.14 wraps it in an
    ObservedException), the body's own error."""
    msg = getattr(e, "msg", None)
    if msg:
        return msg
    causes = _chain(e)[1:]
    if causes:  # the first ScanError it was raised from, else the innermost error
        cause = next((c for c in causes if isinstance(c, ScanError)), causes[-1])
        return f"{type(cause).__name__}: {cause}"
    # torch 2.15 raises the body's error as an ObservedRuntimeError without msg or cause,
    # its text (the error the body raised) in str(e)
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


_ScanCompileError = None


def compile_error(message, real_stack=None):
    """A ScanError that Dynamo lets through as it is: Dynamo re-raises its
    UncapturedHigherOrderOpError unchanged but wraps any other exception raised
    while tracing in an InternalTorchDynamoError."""
    global _ScanCompileError
    if _ScanCompileError is None:
        from .._compat.dynamo import uncaptured_error_class

        UncapturedHigherOrderOpError = uncaptured_error_class()

        class ScanCompileError(ScanError, UncapturedHigherOrderOpError):
            def __init__(self, msg, real_stack=None):
                UncapturedHigherOrderOpError.__init__(self, msg, real_stack)

        _ScanCompileError = ScanCompileError
    return _ScanCompileError(message, real_stack)


@torch.compiler.assume_constant_result  # Dynamo calls it in Python while tracing: its raise is real
def _raise_compile_error(message):
    raise compile_error(message)


def surface(e):
    """Re-raise ScanError ``e`` so that torch.compile(fullgraph=True) shows it. A ScanError raised
    by traced Python (the front end's checks of init, xs, length, options) is an exception Dynamo
    simulates; with no handler in the compiled function it became Dynamo's Unsupported "Observed
    exception", our message left in its debug context. Raised from a function Dynamo runs in
    Python, it is a real ScanError that Dynamo lets through. Outside Dynamo: ``e`` itself."""
    if _compat.is_dynamo_compiling():
        _raise_compile_error(e.args[0])
    raise e


def as_scan_error(e):
    """Dynamo's hard error for a graph break in the body, as a ScanError."""
    return e if isinstance(e, ScanError) else compile_error(_with_hints(e.msg, e), e.real_stack)


_FSDP_HINT = (
    " The body calls a module sharded by FSDP2's fully_shard, whose hooks (the gather of its parameters "
    "before its forward) torch.compile runs outside the graph, so they cannot run inside a scan's body. "
    "Shard the module that calls scan instead (fully_shard on it, not on the module the body calls: its "
    "parameters are then gathered once, before the scan), or use scan_layers for a stack of fully_shard layers.")


def _with_hints(message, e):
    """``message`` with what to do when the graph break is a known one: a body calling an FSDP2
    module (the break is in FSDP2's hook, found on the stack Dynamo kept)."""
    stack = getattr(e, "real_stack", None) or []
    if any("/distributed/fsdp/" in f.filename.replace("\\", "/") for f in stack):
        return message + _FSDP_HINT
    return message


def _wraps_a_raised_error(e):
    """Was ``e`` (a failed capture) an exception the body's own code raised, or one of its ops
    raised on fake tensors, rather than a graph break? Dynamo simulates a ``raise`` in traced code
    as an ObservedException (torch 2.9 to 2.15) and re-raises an op's failed fake run as a
    TorchRuntimeError (2.9) or an ObservedException (2.15) around the op's error."""
    return isinstance(e, _compat.dynamo.raised_error_classes())


def _raised_exception(tx):
    """``(type, args)`` of the exception the body raised, from the translator's exception stack
    (torch 2.9's ObservedException says only ``ExceptionVariable(<class 'ValueError'>)``; 2.15's
    names the arguments itself; torch up to 2.14 ``get_current_exception``, 2.15 ``get_raised_exception``).
    None when it cannot be read."""
    stack = getattr(tx, "exn_vt_stack", None)
    get = getattr(stack, "get_current_exception", None) or getattr(stack, "get_raised_exception", None)
    try:
        exc = get()
        return exc.exc_type, tuple(a.as_python_constant() if a.is_python_constant() else a for a in exc.args)
    except Exception:  # no stack, no current exception, or a translator of another shape
        return None


@contextlib.contextmanager
def tensor_repr_releases_its_guard():
    """Within this block a tensor's repr that raises leaves functorch's keys as they were.

    torch's ``_tensor_str._str`` holds a ``_DisableFuncTorch`` guard in a local variable. When
    the repr raises, the exception's traceback keeps that frame, and with it the guard, alive;
    when the garbage collector frees it, later and at no fixed point, its destructor restores
    the dispatch-key state of the moment it was made: functorch's and autograd's keys excluded
    for the rest of the process. A scan body that Dynamo fails to run on fake tensors under
    ``vmap(jacfwd(...))`` gets such a repr: fake tensor validation renders the failing call, and
    the repr of a dual tensor there raises (torch's own ``_fw_primal`` assert). Every
    ``torch.func`` transform after it then failed ("Cannot access storage of TensorWrapper",
    internal asserts in ``_make_dual``). Here the guard is dropped as the repr returns or raises.
    torch 2.9 to 2.15: ``_tensor_str._str(self, *, tensor_contents)`` = no_grad + modes disabled +
    the guard around ``_str_intern``; ``Tensor.__repr__`` looks ``_str`` up on the module
    (``_compat.dispatch.tensor_str_module``)."""
    tensor_str = _compat.dispatch.tensor_str_module()
    original = tensor_str._str
    intern = getattr(tensor_str, "_str_intern", None)
    if intern is None or getattr(original, "_releases_guard", False):
        yield
        return

    def _str(self, *, tensor_contents=None):
        with torch.no_grad(), _compat.dispatch.current_modes_disabled():
            guard = _compat.functorch.functorch_disabled_guard()
            try:
                return intern(self, tensor_contents=tensor_contents)
            finally:
                del guard

    _str._releases_guard = True
    tensor_str._str = _str
    try:
        yield
    finally:
        tensor_str._str = original
