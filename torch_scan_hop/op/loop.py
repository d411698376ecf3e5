"""Eager scan IS the Python loop: every step runs the body on the autograd tape.

Nothing is traced or cached in eager mode, so whatever the loop supports the
scan supports, with the loop's values, gradients and side effects:
``no_grad`` regions, custom ``autograd.Function``s, hooks, RNG draws, grad-mode
branches, double backward and ``torch.func`` transforms. ``remat`` is realised
by one replay engine per scan (``remat/replay.py``, applied by ``remat/step.py``):

* ``"save_all"``: the plain tape.
* ``"recompute_all"``: each step's inputs are kept; saved values are recomputed
  in the backward from recipes recorded in the forward (``remat/recipes.py``), or,
  for a body calling a function it does not know (a random op), by re-running
  the step (RNG state restored, so dropout masks match; the body's Python side
  effects run again there).
* ``"min_cut"``: at most half of the bytes save_all keeps per step (the carry
  counted), the values whose recompute costs most (``remat/keep.py``); the rest
  is recomputed from recipes, nothing re-run (an unknown function's outputs kept).
* ``save_only_these_names``: the named values are kept, the rest as recompute_all.
* any other ``RematPolicy``: the outputs of the calls that run an op the policy
  saves (and its ``checkpoint_name``d values) are kept where the backward reads
  them, the rest as recompute_all (``remat/policy_ops.py``).
* ``"sqrt"``: every ~sqrt(T)-th carry is kept; blocks are re-run in the backward.
* ``("binomial", k)``: at most k carries, as revolve places them (``remat/revolve.py``).
"""
import contextlib

import torch

from .. import _compat
from ..core import dtensors as dt
from ..core.checks import check_carry, check_pair, flatten_y
from ..core.op_args import slice_example
from ..core.drain import drain_at_thread_end
from ..core.schedule import step_order
from ..core.trees import LEAF, ScanError
from ..remat.step import remat_step
from ..trace.copies import differentiable_copies
from ..trace.closures import writes_in_place
from ..trace.indexing import TensorIndexRewrite


def stack_column(column, k):
    """One y leaf's per-step values -> one tensor (a clear error if shapes drift).
    DTensors of one layout are stacked locally (torch 2.9's DTensor backward of
    ``torch.stack`` returns wrongly shaped gradients)."""
    try:
        if type(column[0]) is torch.Tensor:  # plain tensors, the common case
            return torch.stack(column)
        if dt.is_dtensor(column[0]) and all(dt.is_dtensor(t) and dt.layout_of(t) == dt.layout_of(column[0])
                                            for t in column):
            return dt.stack_locals(column)
        return torch.stack(column)
    except (RuntimeError, TypeError) as e:
        kinds = sorted({(tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else type(t).__name__
                        for t in column}, key=str)
        raise ScanError(
            f"scan: y leaf {k} changed across iterations (saw {kinds}); each step must "
            "return ys of the same structure, shape and dtype."
        ) from e


def stack_ys(ys):
    """Per-step lists of y leaves -> one stacked tensor per leaf."""
    return [stack_column(column, k) for k, column in enumerate(zip(*ys))]


# ---------------------------------------------------------------- the op's loop (flat leaves)

def run_flat(combine_fn, init, xs, additional_inputs, reverse=False, remat=None):
    """``[*final_carry, *ys]`` of the op's flat convention, by a Python loop.

    Slices come from one ``unbind`` per xs leaf (what ``for x in xs`` does), so
    the tape holds one node for all slices instead of one select per step. A
    traced body was traced on dense slices (``slice_example``), and its
    ``view``s may hold only for them: xs laid out otherwise (a vmap's batch dim
    moved behind the scan dim, ``dim=1``) are made dense first.
    """
    drain_at_thread_end()  # a failed backward must not kill the process: see core/drain.py
    num_carry, length = len(init), xs[0].shape[0]
    if length == 0:
        return [*carry_after_no_step(init, op=True), *empty_flat_ys(combine_fn, init, xs, additional_inputs)]
    traced = isinstance(combine_fn, torch.fx.GraphModule)
    if traced and torch.is_grad_enabled():
        combine_fn = differentiable_copies(combine_fn)
    columns = [dt.unbind(x.contiguous() if traced and isinstance(x, torch.Tensor) else x) for x in xs]

    def step(carry, i):
        out = combine_fn(*carry, *(col[i] for col in columns), *additional_inputs)
        return list(out[:num_carry]), list(out[num_carry:])

    step = remat_step(step, remat, length)
    layouts = traced_layouts(init) if traced else None
    carry, ys = list(init) if layouts is None else in_traced_layout(init, layouts), [None] * length
    for i in step_order(length, reverse):
        carry, ys[i] = step(carry, i)
        if layouts is not None:
            carry = in_traced_layout(carry, layouts)
    return [*carry, *stack_ys(ys)]


def traced_layouts(init):
    """The layouts a traced body saw its carries in: ``example_args`` clones init,
    so an expanded or overlapping init was traced as a dense tensor."""
    return [torch.empty_like(c) if type(c) is torch.Tensor else None for c in init]


def in_traced_layout(carry, layouts):
    """A traced body's ``reshape`` may be a ``view`` that only the layout it was
    traced on allows. A new carry in another layout (``tanh(a.t() * b)`` keeps the
    transpose's strides) is copied into that layout before the next step, as the
    compiled loop does; so is init, when it is not dense (a slice of a wider tensor,
    a vmap's batched view of one), which ``example_args`` cloned dense."""
    return [c if ref is None or type(c) is not torch.Tensor or c.shape != ref.shape or c.stride() == ref.stride()
            else torch.empty_like(ref, dtype=c.dtype).copy_(c)
            for c, ref in zip(carry, layouts)]


# ---------------------------------------------------------------- zero length: one rule

def carry_after_no_step(init, *, op):
    """THE zero-length rule: no step runs, so the final carry is ``init``, as after ``for x in []``.

    ``scan`` (the front end, ``op=False``) returns ``init`` itself, the very objects it was
    given, as the Python loop does. The op (``scan_op`` and its rules, ``op=True``) returns
    copies of them: a HigherOrderOperator's outputs must not alias its inputs (functionalization,
    AOTAutograd and torch.export rely on it), so every traced path (make_fx records a clone,
    torch.compile, export, the XLA While) gives new tensors holding init's values. The ys of
    every path are empty, one step's y shape behind a leading 0 (``empty_ys``)."""
    return [c.clone() for c in init] if op else init


def empty_ys(y_slices):
    """The stacked ys of a zero-length scan, from one step's ys (their metadata only)."""
    return [torch.empty((0, *y.shape), dtype=y.dtype, device=y.device) for y in y_slices]


def empty_flat_ys(combine_fn, init, xs, additional_inputs):
    """ys of a zero-length scan: shapes from one fake run of the body (as ``_empty_ys``'s)."""
    with body_shape_run() as mode:
        fake_args = [*(torch.empty_like(stand_in(mode, c)) for c in init),  # dense, as example_args' clones
                     *(stand_in(mode, x, sliced=True) for x in xs),
                     *(stand_in(mode, a) for a in additional_inputs)]
        y_meta = list(combine_fn(*fake_args))[len(init):]
    return empty_ys(y_meta)


@contextlib.contextmanager
def shape_run():
    """The fake mode a zero-length scan runs its body under, to learn the ys' shapes: the
    tracing context's (Dynamo/AOTAutograd's, which asserts that no other mode is active: a
    zero-length scan under ``torch.compile(grad(f))``), else a fresh one; nothing recorded.
    Forward AD is off in it: shapes and dtypes do not depend on tangents, and torch's jvp
    formulas fail on fakes next to a plain tensor (``_compat.forward_ad_disabled``)."""
    mode = _compat.tracing_context_fake_mode() or _compat.fresh_fake_mode()
    with _compat.disable_proxy_modes_tracing(), _compat.forward_ad_disabled(), mode:
        yield mode


def stand_in(mode, t, sliced=False, batched=True):
    """A fake tensor for ``t`` (for one slice of it when ``sliced``) in the fake run that
    learns a zero-length scan's ys, computing nothing.

    Under torch.func transforms ``t`` may be a functorch wrapper: a BatchedTensor, or a
    grad/jvp level's wrapper (under jvp a view of its primal). Meta conversion refuses views
    of those ("view functorch tensors are not supported") and fails its own metadata check
    (``is_leaf``) on a grad level's, so a wrapper gets a fresh fake of what the body sees
    (shape, dtype, device), made inside the active transforms by ``new_empty``: grad and jvp
    treat it as any new tensor, and vmap batches it where ``t`` is batched (its batching
    rule), as the loop's values are. The body's ops on it reach the fake mode below them. An
    unbatched stand-in for a batched carry made the body's values unbatched where the loop's
    are batched, and an in-place op on one by a batched closure (``a.clone().mul_(a @ W)``)
    raised vmap's in-place error, which the loop never does (at length 0 it runs no step).
    The empty ys built from the run hold no values, so the transforms take them as constants:
    empty tangents under jvp, no gradient, a vmap's batch dim added when they leave it. A
    slice of a plain tensor keeps the slice's strides (``for x in xs``'s), without the
    slicing that an empty ``xs`` cannot do. ``batched=False``: a plain fake tensor of what
    the body sees, for a wrapper too (``empty_tree_ys``)."""
    if not isinstance(t, torch.Tensor):
        return t
    if dt.is_dtensor(t):
        return mode.from_tensor(slice_example(t) if sliced else t)
    shape = t.shape[1:] if sliced else t.shape
    if _compat.is_functorch_wrapped(t):
        return t.new_empty(shape) if batched else torch.empty(shape, dtype=t.dtype, device=t.device)
    if sliced:
        return torch.empty_strided(shape, t.stride()[1:], dtype=t.dtype, device=t.device)
    return mode.from_tensor(t)


# ---------------------------------------------------------------- the front end's loop (pytrees)

def _x_slices(inputs):
    """The x pytree of every step, in input order, from one unbind per leaf
    (a plain tensor xs: the unbind's own tuple)."""
    if inputs.xs_spec is None:
        return [None] * inputs.length
    if inputs.xs_spec is LEAF:  # a bare tensor xs: the unbind's own tuple
        return dt.unbind(inputs.xs_leaves[0])
    columns = [dt.unbind(x) for x in inputs.xs_leaves]
    if len(columns) == 1 and inputs.xs_spec.is_leaf():
        return columns[0]
    return [inputs.xs_spec.unflatten(leaves) for leaves in zip(*columns)]


def run_tree(fn, init, inputs, reverse=False, remat="save_all"):
    """``(final_carry, ys)`` of ``fn`` over ``inputs``: the user's loop on the tape.

    Step 0 is checked in full (structure, leaf types, carry shape and dtype);
    later steps pay only for what the loop does anyway, and the final carry is
    checked again (a drift in between surfaces there or when ys are stacked).
    The steps iterate the slices as ``for x in xs`` does, calling ``fn`` itself
    (no wrapper per step): at T=256 a wrapper call per step is ~5% of the loop.
    """
    drain_at_thread_end()  # a failed backward must not kill the process: see core/drain.py
    if inputs.length == 0:
        return carry_after_no_step(init, op=False), empty_tree_ys(fn, inputs)
    slices = _x_slices(inputs)
    xs_in_order = iter(reversed(slices) if reverse else slices)
    step = fn if remat == "save_all" else remat_step(fn, remat, inputs.length)
    out = step(init, next(xs_in_order))
    if type(out) is not tuple or len(out) != 2:
        check_pair(out)
    carry, y = out
    check_carry(carry, inputs)
    if isinstance(y, torch.Tensor):  # one tensor y: stacked as a flat list
        ys = [y]
        for x in xs_in_order:
            out = step(carry, x)
            if type(out) is not tuple or len(out) != 2:
                check_pair(out)
            carry, y = out
            ys.append(y)
        check_carry(carry, inputs)
        return carry, stack_column(ys[::-1] if reverse else ys, 0)
    y_leaves, y_spec = flatten_y(y)
    ys = [y_leaves]
    for x in xs_in_order:
        carry, y = check_pair(step(carry, x))
        ys.append(_same_structure_y(y, y_spec))
    check_carry(carry, inputs)
    return carry, y_spec.unflatten(stack_ys(ys[::-1] if reverse else ys))


def empty_tree_ys(fn, inputs):
    """The ys pytree of a zero-length scan: fn runs once under a fake tensor
    mode (nothing is computed) to learn the structure, shapes and dtypes.

    Under vmap the stand-ins are batched where the inputs are (``stand_in``). If the body
    then meets vmap's in-place refusal, it runs again on unbatched stand-ins: the loop never
    calls it at length 0, so a body that refuses one batching must still get its empty ys
    (one mixing a batched closure into an unbatched x slice in place, ``v.clone().mul_(x)``;
    the other way round, ``a.clone().mul_(a @ W)`` with ``a`` a batched carry, is why the
    first run batches). An empty y holds no value, so its per-example shape is all it needs."""
    try:
        return _empty_ys(fn, inputs, batched=True)
    except RuntimeError as e:
        if not _compat.is_vmap_inplace_error(e):
            raise
    return _empty_ys(fn, inputs, batched=False)


@contextlib.contextmanager
def body_shape_run():
    """``shape_run`` for a call of the user's body: with the index rewrite as in a trace (a fake
    step index, ``with_index``, cannot be read as a number: ``buf[t]``, ``buf.select(0, t)``) and
    its writes into tensors from outside it on stand-ins (``_WritesOnStandIns``)."""
    with shape_run() as mode, TensorIndexRewrite(refuse_lost_writes=False), _WritesOnStandIns(mode):
        yield mode


class _WritesOnStandIns(torch.overrides.TorchFunctionMode):
    """The ys' shape run writes into nothing from outside it: a tensor it did not make (a closed-over
    buffer, ``cache[t] = h``) written in place is, from that write on, a fake stand-in. Written
    itself, it took fake values (a functorch wrapper's value) or their autograd history; the loop
    never calls the body at length 0."""

    def __init__(self, mode):
        super().__init__()
        self.mode, self.swapped = mode, {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        target = args[0] if args else None
        if isinstance(target, torch.Tensor) and not isinstance(target, _compat.FakeTensor) \
                and id(target) not in self.swapped and writes_in_place(func):
            with _compat.disable_proxy_modes_tracing():
                self.swapped[id(target)] = (stand_in(self.mode, target), target)  # target kept: ids are keys
        if self.swapped:
            swap = lambda t: self.swapped.get(id(t), (t,))[0] if isinstance(t, torch.Tensor) else t  # noqa: E731
            args, kwargs = _compat.pytree.tree_map(swap, (args, kwargs or {}))
        try:
            return func(*args, **(kwargs or {}))
        except RuntimeError as e:
            if not (_compat.is_vmap_inplace_error(e) and isinstance(target, torch.Tensor) and writes_in_place(func)):
                raise
            args = (self._batched(args[0], _compat.pytree.tree_leaves((args[1:], kwargs or {}))), *args[1:])
        return func(*args, **(kwargs or {}))

    def _batched(self, target, others):
        """vmap refused to write a batched value into the unbatched ``target`` (a closed-over buffer, an
        unbatched stand-in of a carry: ``buf[t] = row``, ``c.mul_(w)``). The loop never runs this write,
        and the ys' shapes do not depend on it: from here on the run writes into and reads a batched
        copy of ``target`` (batched by adding 0 times the batched values; the same shape and dtype)."""
        zero = sum((o.sum() * 0).to(target.dtype) for o in others
                   if isinstance(o, torch.Tensor) and o.dtype != torch.bool)
        batched = target + zero
        for key, (value, *rest) in list(self.swapped.items()):
            if value is target:  # a tensor from outside, already swapped: now for the batched copy
                self.swapped[key] = (batched, *rest)
        self.swapped[id(target)] = (batched, target)  # target kept: ids are keys
        return batched


def _empty_ys(fn, inputs, batched):
    with body_shape_run() as mode:
        carry = inputs.init_spec.unflatten([stand_in(mode, t, batched=batched) for t in inputs.init_leaves])
        x = None if inputs.xs_spec is None else inputs.xs_spec.unflatten(
            [stand_in(mode, t, sliced=True, batched=batched) for t in inputs.xs_leaves])
        new_carry, y = check_pair(fn(carry, x))
        check_carry(new_carry, inputs)
        y_leaves, y_spec = flatten_y(y)
    return y_spec.unflatten(empty_ys(y_leaves))


def _same_structure_y(y, y_spec):
    leaves, spec = flatten_y(y)
    if spec != y_spec:
        raise ScanError(f"scan: fn returned y with structure {spec} after {y_spec}; "
                        "y must have the same structure at every step.")
    return leaves
