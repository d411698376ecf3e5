"""Which path a scan takes: the eager loop, Dynamo, XLA's eager entry or the op.

Every front end and rule asks here, so that one decision says when a scan IS the Python loop
(``scan``, ``scan_layers``, the op's autograd and subclass rules, ``checkpoint_name``) and a
change to it reaches all of them. The answer depends on the active tracers and the tensors
only, never on the body.
"""
from .. import _compat
from . import modes, trace_lock

LOOP = "loop"  # the Python loop on the autograd tape (op/loop.py)
DYNAMO = "dynamo"  # torch.compile is tracing: op/dynamo.py captures the body as a subgraph
XLA_EAGER = "xla_eager"  # an eager call on XLA tensors: cached on Dynamo's guards (xla/eager.py)
OP = "op"  # the HigherOrderOperator on a traced body (make_fx, export, XLA, functionalize)


def runs_the_loop(tensors, remat="save_all"):
    """The scan is the Python loop: no tracer is active and every tensor holds real data off
    XLA (modes that trace nothing and torch.func's wrappers count as eager; see
    ``core.modes.runs_eagerly``). A partition function as ``remat`` only means something to a
    traced backward, so with one the op runs, traced in eager."""
    return not callable(remat) and modes.runs_eagerly(tensors)


def route(tensors, remat="save_all", *, xla_eager=None):
    """The path of one scan over ``tensors`` (its init and xs leaves).

    ``xla_eager``: a function saying whether XLA's eager entry takes the call (it knows the
    body; only the outermost call of ``scan`` offers it). In order: under Dynamo the capture
    (it sees the whole call); the loop, also for a scan nested in a body traced for XLA
    (its steps inline into the outer step) and under a differentiating torch.func transform
    (which differentiates the loop's ops as they run); XLA's eager entry; else the op."""
    if _compat.is_dynamo_compiling():
        return DYNAMO
    if runs_the_loop(tensors, remat) or (not callable(remat) and nested_on_xla(tensors)):
        return LOOP
    if differentiated_by_a_transform(tensors):
        return LOOP
    if xla_eager is not None and xla_eager():
        return XLA_EAGER
    return OP


def nested_on_xla(tensors):
    """A scan in the body of a scan on XLA, met while the outer body is traced:
    its steps are traced inline into the outer step (the inner loop unrolled in
    the outer While's body). Its own scan node there would carry the outer
    trace's fake stand-ins of the closures it lifted as if they were inputs."""
    return trace_lock.inside_our_trace() and _compat.on_xla(tensors)


def differentiated_by_a_transform(tensors):
    """torch.func.grad (or jvp, vjp, jacrev...) active, in eager or inside make_fx: the loop
    runs (or is traced), each step's ops differentiated by the transform as they run; with a
    partition function as ``remat`` too, which only chooses what a backward keeps (the
    transform keeps its own). The op's path would trace its body graph under the live
    transform: inside make_fx from the wrapped tensors, whose values entered the graph as
    constants (a zero gradient); in eager, with closures wrapped by the transform and inputs
    that are not (grad with respect to a weight only), that graph's example values came out
    wrapped by the transform, not fake ("Only fake tensor is allowed", torch 2.15 "Cannot
    access storage of TensorWrapper")."""
    if not _compat.differentiating_transform_active():
        return False
    return _compat.dispatch_modes_active() or modes.runs_eagerly(tensors)
