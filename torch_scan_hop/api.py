"""The user-facing ``scan``: pytrees, validation, the eager loop or the traced op."""
import contextlib
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from . import _compat
from .core import modes, route, trace_lock
from .core.checks import check_carry, check_pair, flatten_y, mutation_message
from .core.op_args import example_args
from .core.schedule import sqrt_split
from .core.step_index import with_step_index
from .core.torch_xla_keywords import remat_with_torch_xla_keywords
from .core.trees import LEAF, ScanError, ScanInputs, flatten, prepare_inputs, shown
from .op.compile_errors import surface
from .op.hop import scan_op
from .op.loop import run_tree
from .remat.policies import Remat, as_token, validated
from .trace import cache
from .trace.body_checks import is_leaf_write_error, mark_checked, writes_only_carries, written_inputs
from .trace.closure_writes import ClosureWrites, carries_closures, closures_carried
from .trace.flat_body import copied_carries, dynamo_body
from .trace.indexing import TensorIndexRewrite
from .trace.lift import forget_source, source_of, trace_and_lift
from .xla import eager as xla_eager

Carry = TypeVar("Carry")  # the carry pytree: init's structure, kept across steps
X = TypeVar("X")  # the xs pytree (fn gets one slice of it)
Y = TypeVar("Y")  # one step's output pytree (scan returns them stacked)


class FlatBody:
    """``fn(carry, x) -> (carry, y)`` as the op's flat body ``(*carry, *x) -> [*carry, *y]``.

    Validates every call (structure, leaf types, carry shape/dtype) and
    remembers the y pytree spec for unflattening the stacked ys.
    """

    def __init__(self, fn, inputs: ScanInputs):
        self.fn, self.inputs, self.y_spec = fn, inputs, None
        self.copy_carry = False  # set when the body writes into its carry in place: see _traced_body

    def __call__(self, *args):
        inputs = self.inputs
        nc = inputs.num_carry
        if self.copy_carry:
            args = copied_carries(args, nc)
        carry = inputs.init_spec.unflatten(args[:nc])
        x = None if inputs.xs_spec is None else inputs.xs_spec.unflatten(args[nc:nc + inputs.num_x])
        new_carry, y = check_pair(self.fn(carry, x))
        carry_leaves = check_carry(new_carry, inputs)
        y_leaves, self.y_spec = flatten_y(y)
        return [*carry_leaves, *y_leaves]


def _checked_options(fn, reverse, remat, unroll, with_index=False):
    """The options, checked; returns ``remat`` as ``validated`` gives it."""
    remat = validated(remat)
    if not callable(fn):
        raise ScanError(f"scan: fn must be callable as fn(carry, x) -> (new_carry, y), got {type(fn).__name__}.")
    for name, value in (("reverse", reverse), ("with_index", with_index)):
        if not isinstance(value, bool):
            raise ScanError(f"scan: {name} must be a bool, got {shown(value)}.")
    if unroll is not None and (not isinstance(unroll, int) or isinstance(unroll, bool) or unroll < 1):
        raise ScanError(f"scan: unroll must be None or an int >= 1, got {shown(unroll)}.")
    return remat


def scan(fn: Callable[[Carry, X], tuple[Carry, Y]], init: Carry, xs: X | None = None, *,
         length: int | None = None, reverse: bool = False, dim: int = 0, remat: Remat = "save_all",
         unroll: int | None = None, with_index: bool = False, partition_fn: Callable[..., Any] | None = None,
         is_fn_pure: bool | None = None) -> tuple[Carry, Y]:
    """Loop ``fn(carry, x) -> (new_carry, y)`` over the slices of ``xs`` along ``dim``.

    What it computes, as ``jax.lax.scan`` (and upstream torch's scan) define it, is this
    Python loop (``xs`` a pytree, ``x`` its slice ``i`` along ``dim``; ``ys`` stacked along dim 0,
    in input order also when ``reverse=True``)::

        def scan(fn, init, xs, length=None, reverse=False, dim=0):
            n = length if xs is None else xs.shape[dim]
            carry, ys = init, [None] * n
            for i in (reversed(range(n)) if reverse else range(n)):
                x = None if xs is None else xs.select(dim, i)
                carry, ys[i] = fn(carry, x)
            return carry, torch.stack(ys)

    In plain eager it IS that loop, on the autograd tape, so its values, gradients and side
    effects are the loop's (``remat`` applied per step). Under a tracer (make_fx,
    torch.compile, torch.export) and on XLA tensors it is ONE scan node / one XLA While:
    tensors ``fn`` closes over are lifted into the op's ``additional_inputs`` and receive
    gradients, the body is traced once whatever the length.

    Args:
        fn: the step, ``fn(carry, x) -> (new_carry, y)``. ``new_carry`` has ``init``'s pytree
            structure and each leaf its shape and dtype; ``y`` is any pytree of tensors (None
            for no per-step output) of the same structure, shapes and dtypes at every step.
            With ``with_index=True`` it is called ``fn(carry, x, i)``. It may write into its carry
            in place (``c.mul_(a)``, ``buf[:, t] = h`` with ``t`` a 0-d int tensor, also on traced
            paths), and into a closed-over tensor, which holds after the scan what the loop leaves
            in it (make_fx, non-strict export, XLA; not under torch.compile). Traced, it must not
            write into ``x`` (a view of ``xs``).
        init: the initial carry, a pytree (dict, list, tuple, namedtuple) of tensors of any
            dtype; None leaves mean "no value".
        xs: a pytree of tensors scanned along ``dim`` (all of one length), or None with
            ``length``: then ``fn`` gets ``x=None``.
        length: the number of steps; required when ``xs`` is None, must agree with ``xs``
            otherwise.
        reverse: run from the last slice to the first (``ys`` stay in input order).
        dim: the axis of every ``xs`` leaf to scan along (``ys`` are stacked along dim 0).
        remat: what the backward keeps per step, the rest recomputed: "save_all",
            "recompute_all", "min_cut", "sqrt", ``("binomial", k)``, a ``RematPolicy``
            (``dots_saveable``, ``save_only_these_names(...)``) or an AOTAutograd partition
            function (traced paths; eager then traces too).
        unroll: body calls per loop iteration in traced graphs and the XLA While (None: 1);
            eager ignores it.
        with_index: also pass the step's index ``i`` to ``fn``, a 0-d int64 tensor: the index
            into ``xs`` of the slice being processed (``T - 1`` down to 0 for ``reverse=True``,
            as in the loop above); no need to carry a counter. A slice of an internal
            ``arange`` scanned with ``xs``: its value is never read as a Python number.
        partition_fn: torch_xla.experimental.scan's name for ``remat`` (give one of the two).
        is_fn_pure: torch_xla.experimental.scan's cache flag: accepted, changes nothing.

    Returns:
        ``(final_carry, ys)``: the carry after the last step (at length zero ``init`` itself,
        ``op.loop.carry_after_no_step``) and the per-step ``y``s stacked along a new dim 0
        (empty, with one step's shape behind the 0, at length zero).

    Raises:
        ScanError: bad input or a body breaking the contract above, naming the leaf path and
            what differs (``scan: the carry leaf carry['h'] changed across an iteration: shape
            (2, 6) vs init's (2, 3)``); traced, also a body reading a tensor's value as a
            Python value or writing into an x slice (or, under torch.compile, a closed-over
            tensor) in place.

    Example:
        >>> import torch
        >>> from torch_scan_hop import scan
        >>> def cumsum(total, x):
        ...     total = total + x
        ...     return total, total
        >>> final, ys = scan(cumsum, torch.tensor(0.0), torch.arange(4.0))
        >>> final, ys
        (tensor(6.), tensor([0., 1., 3., 6.]))
        >>> scan(lambda c, x, i: (c + i * x, i), torch.tensor(0), torch.ones(3, dtype=torch.long), with_index=True)
        (tensor(3), tensor([0, 1, 2]))
    """
    if partition_fn is not None or is_fn_pure is not None:
        remat = remat_with_torch_xla_keywords(remat, partition_fn, "is_fn_pure", is_fn_pure, "scan")
    if (type(init) is type(xs) is torch.Tensor and length is None and unroll is None and type(dim) is int
            and with_index is False
            and dim == 0 and type(reverse) is bool and type(remat) is str and remat == "save_all"
            and callable(fn) and xs.dim() > 0 and route.runs_the_loop((init, xs))):
        # The most common call (one tensor carry and xs, defaults, plain eager): the options
        # and inputs need no check beyond the condition above, and the loop starts at once.
        return run_tree(fn, init, ScanInputs([init], LEAF, [xs], LEAF, xs.shape[0]), reverse, remat)
    try:
        remat = _checked_options(fn, reverse, remat, unroll, with_index)
        inputs = prepare_inputs(init, xs, length, dim)
    except ScanError as e:
        surface(e)  # under torch.compile, as a ScanError rather than Dynamo's "Observed exception"
    leaves = [*inputs.init_leaves, *inputs.xs_leaves]
    user_fn = fn
    if with_index:
        fn, inputs = with_step_index(fn, inputs)
    if route.runs_the_loop(leaves, remat):
        return run_tree(fn, init, inputs, reverse, remat)  # plain eager, the common case: the loop
    path = route.route(leaves, remat, xla_eager=lambda: xla_eager.applies(user_fn, leaves, remat))
    if path == route.XLA_EAGER:  # keyed by the user's fn: the index is added inside (_scan_entry)
        options = {"length": length, "reverse": reverse, "dim": dim, "remat": remat, "unroll": unroll,
                   "with_index": with_index}
        if xla_eager.first_sight(user_fn, leaves, options):  # traced once with make_fx: cheaper than a capture
            try:
                return _scan(fn, init, inputs, reverse, remat, unroll or 1)
            except Exception as e:
                if not xla_eager.needs_capture(e):
                    raise
        return _scan_on_xla(user_fn, init, xs, options)
    return _scan(fn, init, inputs, reverse, remat, unroll, path)


def _scan(fn, init, inputs, reverse, remat, unroll, path=None):
    """One scan past the front end's checks, on the path ``route`` gives (``path``: already
    asked). XLA's eager entry is offered by ``scan`` only: here it is taken or refused."""
    path = path or route.route([*inputs.init_leaves, *inputs.xs_leaves], remat)
    if path == route.DYNAMO:  # op.dynamo captures fn as a subgraph, closures lifted
        if _two_level(remat, inputs):
            return _sqrt_scan(fn, init, inputs, reverse, unroll)
        out = scan_op(dynamo_body(fn, inputs), inputs.init_leaves, inputs.xs_leaves, (),
                      reverse=reverse, remat=remat, unroll=1 if unroll is None else unroll)
        return inputs.init_spec.unflatten(out[:inputs.num_carry]), out[inputs.num_carry]
    if path == route.LOOP:  # a transform keeps its own saved values: a partition function means nothing
        # the loop unrolled into a trace (make_fx of a torch.func transform): buf[t] reads t as the traced
        # paths do, as an index (t, a slice of a traced arange, has no value to read in real mode)
        traced = not modes.runs_eagerly([*inputs.init_leaves, *inputs.xs_leaves])
        with TensorIndexRewrite() if traced else contextlib.nullcontext():
            return run_tree(fn, init, inputs, reverse, "save_all" if callable(remat) else remat)
    if _two_level(remat, inputs):
        return _sqrt_scan(fn, init, inputs, reverse, unroll)
    try:
        flat_out, y_spec = _call_op(fn, inputs, reverse=reverse, remat=as_token(remat), unroll=unroll or 1)
    except ClosureWrites as e:
        if carries_closures(fn):  # carried, still written: carrying them again would never end
            written = ", ".join(f"shape {tuple(t.shape)} {t.dtype}" for t in e.tensors)
            raise ScanError(f"scan: the body writes into closed-over tensors ({written}) that this "
                            "scan already carries, and the trace still finds the writes: the body reaches "
                            "them where no torch function mode sees it (with torch functions "
                            "disabled). Pass those tensors in the carry.") from None
        return _scan_carrying(e.tensors, fn, init, inputs, reverse, remat, unroll)
    nc = inputs.num_carry
    carry = inputs.init_spec.unflatten(flat_out[:nc])
    return carry, y_spec.unflatten(flat_out[nc:])


def _scan_carrying(closures, fn, init, inputs, reverse, remat, unroll):
    """The scan of a body writing into the closed-over ``closures``, with them carried
    (``trace.closure_writes``); their final values are copied into them, as the loop leaves them."""
    xs = None if inputs.xs_spec is None else inputs.xs_spec.unflatten(inputs.xs_leaves)
    # a closure with a history (``buf = base.clone()``) starts the carry as a copy: the op may save
    # its init for the backward, and the copy into it below would have modified that saved value
    wide = (init, [c.clone() if c.requires_grad and torch.is_grad_enabled() else c for c in closures])
    (carry, finals), ys = _scan(closures_carried(fn, closures), wide,
                                prepare_inputs(wide, xs, inputs.length if xs is None else None, 0),
                                reverse, remat, unroll)
    if type(inputs.length) is int and inputs.length == 0:  # no step wrote them: as the loop leaves them
        return carry, ys  # (under vmap a final carry may be batched where the closure is not: no copy_)
    # no_grad only where autograd would refuse the copy (into a leaf that requires grad, of values
    # that need none): under export a grad-mode region is a node of the program (torch.export.load
    # rejected it: "wrap_with_set_grad_enabled is missing val field")
    refused = any(u.requires_grad and u.is_leaf for u in closures) and not any(f.requires_grad for f in finals)
    with torch.no_grad() if refused else contextlib.nullcontext():
        for user, final in zip(closures, finals):
            user.copy_(final)
    return carry, ys


def _raise_if_closures_written(gm, inputs):
    """``ClosureWrites`` for a body graph that writes into closed-over tensors (and into no x)."""
    first = inputs.num_carry + inputs.num_x
    written = written_inputs(gm)
    if any(i >= first for i in written) and not any(inputs.num_carry <= i < first for i in written):
        users = source_of(gm).lifted
        raise ClosureWrites([users[i - first] for i in written if i >= first])


def _two_level(remat, inputs):
    """Traced ``"sqrt"`` of a static length >= 2 is two scans (``_sqrt_scan``). A symbolic
    length (``torch.compile(dynamic=True)``, make_fx's symbolic mode) stays one scan partitioned
    as ``"recompute_all"`` (one carry saved per step), as binomial does: blocks of a symbolic
    size would guard on ``T % k`` and symbolic nested lengths do not lower in inductor."""
    return isinstance(remat, str) and remat == "sqrt" and _known_int(inputs.length) and inputs.length >= 2


def _known_int(n):
    """Is the int ``n`` known at trace time: a Python int, not a size left symbolic
    (``torch.compile(dynamic=True)``, make_fx's symbolic mode)?

    Under Dynamo a symbolic int passes ``isinstance(n, int)`` and ``type(n) is int``,
    and comparing it installs a guard (one graph per value); ``statically_known_true``
    (``_compat.tracing``) is evaluated by Dynamo on the symbol without a guard. Any known
    int is below 2**62; a backed size symbol's range is unbounded above, so the bound is
    not known for it."""
    return isinstance(n, (int, torch.SymInt)) and _compat.tracing.statically_known_true(n < 2 ** 62)


def _sqrt_scan(fn, init, inputs, reverse, unroll):
    """Traced ``remat="sqrt"``: two-level checkpointing (haliax's ``nested``) as two scans.

    A traced scan's backward reads per-step values its forward stacked, so one scan can only
    save per step: ``"recompute_all"`` keeps T carries. Here an OUTER scan over T // k blocks
    (k = ceil(sqrt(T))) runs, as its body, an INNER scan over one block of k steps. The outer
    scan is partitioned as ``"recompute_all"``: it saves its step inputs only, the carry at each
    block start (T/k carries) and its x block, a view of xs that the backward reads from xs
    itself (not stacked). Its backward step re-runs the block's inner scan, which saves all
    (``"save_all"``: one block's activations, alive during that backward step only) and
    differentiates it: one extra forward in all, as eager's ``"sqrt"``. The ``T % k`` steps
    left over run as a tail scan that saves its carries (fewer than k). Nested scans are
    traced on every path (make_fx, Dynamo, export, XLA), so the rewrite serves them all.
    """
    k, (start, stop) = sqrt_split(inputs.length, reverse)
    spec = inputs.xs_spec

    def part(carry, begin, end, block):  # steps [begin, end) as ScanInputs (xs in blocks of `block`)
        n = (end - begin) // block
        if spec is None:
            return prepare_inputs(carry, None, n, 0)
        xs = [x.narrow(0, begin, end - begin) for x in inputs.xs_leaves]  # views of xs: nothing copied
        return prepare_inputs(carry, spec.unflatten([x.unflatten(0, (n, block)) if block > 1 else x for x in xs]),
                              None, 0)

    def block(carry, x):  # the outer body: one block's k steps as an inner scan
        return _scan(fn, carry, prepare_inputs(carry, x, None if spec is not None else k, 0), reverse, "save_all",
                     unroll)

    carry, ys = _scan(block, init, part(init, start, stop, k), reverse, "recompute_all", 1)
    ys_leaves, y_spec = flatten(ys)
    ys_leaves = [y.flatten(0, 1) for y in ys_leaves]  # (blocks, k, ...) -> (blocks * k, ...), in order
    begin, end = (0, start) if reverse else (stop, inputs.length)
    if begin < end:  # the T % k steps left over: a tail saving its (fewer than k) carries
        carry, tail = _scan(fn, carry, part(carry, begin, end, 1), reverse, "recompute_all", unroll)
        pieces = zip(flatten(tail)[0], ys_leaves)
        ys_leaves = [torch.cat((t, y) if reverse else (y, t)) for t, y in pieces]
    return carry, y_spec.unflatten(ys_leaves)


def _scan_entry(fn, init, xs, *, length, reverse, dim, remat, unroll, with_index):
    """What ``xla_eager`` hands to Dynamo: ``scan`` without the route to it."""
    inputs = prepare_inputs(init, xs, length, dim)
    if with_index:
        fn, inputs = with_step_index(fn, inputs)
    return _scan(fn, init, inputs, reverse, remat, unroll or 1)


def _scan_on_xla(fn, init, xs, options):
    """Through Dynamo (a guard check per unchanged call); a body it cannot
    capture runs on the make_fx path, which also raises the user's own errors."""
    try:
        return xla_eager.call(_scan_entry, fn, init, xs, options)
    except xla_eager.NotCaptured as e:
        failure = e
    result = _scan_entry(fn, init, xs, **options)
    xla_eager.refuse(failure)  # only once the make_fx path succeeded: a user error is not Dynamo's
    return result


def _call_op(fn, inputs, **kwargs):
    """Run the op on the flat inputs, the body traced with its closures lifted;
    returns (flat outputs, y spec)."""
    init, xs = inputs.init_leaves, inputs.xs_leaves
    if not trace_lock.under_make_fx() and any(modes.is_functional(t) for t in (*init, *xs)):
        # Under torch.func.functionalize in eager make_fx cannot see through
        # the wrappers; the Functionalize rule unwraps and runs the body directly.
        # A body writing into its carries writes into copies (no trace says here whether it does).
        body = FlatBody(fn, inputs)
        body.copy_carry = True
        return scan_op(body, init, xs, (), **kwargs), body.y_spec
    with trace_lock.tracing_lock():
        gm, lifted, y_spec = _traced_body(fn, inputs)
        out = scan_op(gm, init, xs, tuple(lifted), **kwargs)
    if _compat.on_xla([*init, *xs]) and not _compat.dispatch_modes_active() and not trace_lock.under_make_fx():
        forget_source(gm)  # an eager call on XLA: nothing reads the graph again
    return out, y_spec


def _traced_body(fn, inputs):
    """The lifted body graph: traced on every call (only a graph can say what
    fn computes; work on it is reused by graph, see cache.graph_key)."""
    body = FlatBody(fn, inputs)
    gm, lifted = _trace_on_copies_if_written(body, inputs)
    _raise_if_closures_written(gm, inputs)
    if not trace_lock.under_make_fx():  # checked once here, on the graph we already have
        mark_checked(gm, inputs.num_carry, inputs.num_x)
    return gm, lifted, body.y_spec


def _trace_on_copies_if_written(body, inputs):
    """``trace_and_lift(body)``; a body that writes into its carries in place (and into no other
    input) is traced again on copies of them (``FlatBody.copy_carry``): its graph then takes the
    written values as the new carry, and the op's inputs are never written."""
    def traced():
        with _compat.disable_proxy_modes_tracing():
            args = example_args(inputs.init_leaves, inputs.xs_leaves, ())
        return trace_and_lift(body, args)

    try:
        gm, lifted = traced()
        if not writes_only_carries(gm, inputs.num_carry):
            return gm, lifted
    except RuntimeError as e:  # a write into a carry requiring grad fails at once
        if not is_leaf_write_error(e):
            raise
    body.copy_carry = True
    try:
        gm, lifted = traced()
        writes_only_carries(gm, inputs.num_carry)  # records what it writes (closed-over tensors: carried)
        return gm, lifted
    except RuntimeError as e:
        if is_leaf_write_error(e):
            raise ScanError(mutation_message("an x slice or closed-over tensor that requires grad")) from e
        raise


def clear_cache():
    """Forget every cached plan and lowering, and the compiled entries of eager
    scans on XLA (never needed for correctness)."""
    xla_eager.clear()
    cache.clear()
