"""Stacking the layers' weights for ``scan_layers``: ``torch.stack`` with two cheaper routes.

* Under ``torch.compile`` the stack is a custom op, so inductor calls ATen's
  stack instead of generating code for it: a generated cat of 64 inputs per
  weight made compile time grow by ~11 s from depth 8 to 64.
* On XLA the backward gathers each layer's gradient row instead of slicing
  it: XLA's CPU compiler spends ~5 ms per slice output, 4 s at depth 64
  (``rows_of``; stacked storage on XLA hands out its gradient rows the same way).
  A row is ``squeeze_copy`` of the gathered ``[1, ...]`` row, not ``squeeze``:
  the squeezed row was a view whose base the sync also returned, so XLA
  wrote every layer's gradient twice (``aten.index`` by a 0-d index, the
  other copy-free form, adds five IR nodes per row to normalize the index).
  Under SPMD each row gets the sharding of the weight it is the gradient of.
  A scan that runs straight-line (``unroll`` covering every layer, csrc/hlo_straight.h)
  makes its gradient stack a concatenation of per-layer rows: there the rows are
  static slices (``static_rows``), which XLA resolves to each row itself, where a
  gather by an index tensor is a copy out of a 2 MB concatenation per weight at
  depth 8 of benchmarks/xla_long.py (the compile cost of a slice is per layer, and
  such a stack is short).
* Eager on XLA (a plain ``scan_layers`` call, outside torch.compile) the stack
  is a plain ``autograd.Function`` with the same backward: through the custom
  op's Python autograd wrapper a stack of 64 weights cost 0.34 ms per call,
  0.21 ms this way (torch.stack itself: 0.04). One Function stacks every
  parameter name of a layer (``stack_state``): each ``apply`` costs ~0.1 ms.

Eager CPU/GPU and ``torch.export`` keep plain ``aten.stack`` (fastest, and the
exported program stays free of our ops).
"""
import torch

from .. import _compat
from ..core import dtensors as dt
from ..xla import sharding


def stack_state(states, static_rows=False):
    """``{name: stack_weights([state[name] for state in states])}`` for every name of
    ``states[0]``. Eager on XLA, one ``_StackManyOnXla`` stacks every name that needs a
    gradient: each ``autograd.Function`` call costs Python time (``_compat.apply_unbound``),
    and a stack per name paid it once per parameter name of the layer."""
    groups = {name: [state[name] for state in states] for name in states[0]}
    many = [name for name, group in groups.items() if _stacks_on_xla(group)]
    out = {name: stack_weights(group, static_rows) for name, group in groups.items() if name not in many}
    if many:
        flat = [t for name in many for t in groups[name]]
        out.update(zip(many, _compat.apply_unbound(_StackOnXla, static_rows, tuple(len(states) for _ in many), *flat)))
    return {name: out[name] for name in groups}  # the layer's own order


def _stacks_on_xla(tensors):
    """Does a stack of these tensors take ``_StackOnXla``?"""
    return (not dt.is_dtensor(tensors[0]) and not _compat.is_dynamo_compiling() and torch.is_grad_enabled()
            and any(t.requires_grad for t in tensors) and _compat.on_xla(tensors))


def stack_weights(tensors, static_rows=False):
    """``torch.stack(tensors)``, the gradient of the result flowing back to each tensor.
    DTensors (FSDP2's sharded parameters) are stacked locally: the stack is laid out as
    they are, a sharded dim shifted by the new dim 0 (no communication). ``static_rows``:
    the scan runs straight-line on XLA (see the module docstring)."""
    if dt.is_dtensor(tensors[0]):
        return dt.stack_locals(tensors, stack_weights)
    if _compat.is_dynamo_compiling() and not _compat.is_exporting():
        return stack_weights_op(tensors)
    if _stacks_on_xla(tensors):
        return _compat.apply_unbound(_StackOnXla, static_rows, (len(tensors),), *tensors)[0]
    return torch.stack(tensors)


class _StackOnXla(torch.autograd.Function):
    """``stack_weights_op`` for an eager call on XLA tensors, for one or several stacks at
    once: ``sizes`` splits the flat tensors into the groups stacked (one per parameter
    name); same forward and backward, without the custom op's per-call wrapping (see the
    module docstring)."""

    @staticmethod
    def forward(static_rows, sizes, *tensors):
        return tuple(torch.stack(group) for group in _split(tensors, sizes))

    @staticmethod
    def setup_context(ctx, inputs, output):  # this form, not forward(ctx, ...): torch.func accepts it
        ctx.static_rows, ctx.shardings = inputs[0], sharding.of(inputs[2:])

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *_gradient_rows(grads, ctx.static_rows, ctx.shardings))


def _split(flat, sizes):
    out, start = [], 0
    for n in sizes:
        out.append(flat[start:start + n])
        start += n
    return out


@torch.library.custom_op("torch_scan_hop::stack_weights", mutates_args=())
def stack_weights_op(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(tensors)


@stack_weights_op.register_fake
def _stack_weights_fake(tensors):
    return torch.stack(tensors)


def _setup_context(ctx, inputs, output):
    ctx.static_rows = False
    ctx.shardings = sharding.of(inputs[0])  # XLA SPMD: each layer's gradient sharded as its weight


def rows_of(t, static=False):
    """``t``'s rows along dim 0: views, or on XLA gathered rows, or static ones (see above)."""
    if _compat.on_xla([t]):
        if static:
            return [torch.select_copy(t, 0, i) for i in range(t.shape[0])]
        return [torch.squeeze_copy(t.index_select(0, row), 0) for row in _row_indices(t.device, t.shape[0])]
    return list(t.unbind(0))


def _gradient_rows(grads, static_rows, shardings):
    """Each stacked weight's gradient as its layers' rows, each with its weight's sharding."""
    rows = [row for grad in grads for row in rows_of(grad, static_rows)]
    return [sharding.like(row, s) for row, s in zip(rows, shardings)]


def _stack_weights_backward(ctx, grad):
    return _gradient_rows([grad], ctx.static_rows, ctx.shardings)


stack_weights_op.register_autograd(_stack_weights_backward, setup_context=_setup_context)

_ROWS = {}


def _row_indices(device, n):
    """One-element index tensors 0..n-1, made once per device (device data, not per-step uploads).

    While a graph is traced (openxla's AOTAutograd, make_fx) they are made afresh and become the
    graph's constants: a cached real tensor is refused by fake tensor mode ("Please convert all
    Tensors to FakeTensors first": an eager XLA step, then the same model compiled), and a tensor
    made under tracing must not be cached for a later eager step."""
    if _compat.dispatch_modes_active():
        return _new_row_indices(device, n)
    key = (str(device), n)
    if key not in _ROWS:
        _ROWS[key] = _new_row_indices(device, n)
    return _ROWS[key]


def _new_row_indices(device, n):
    return [torch.tensor([i], device=device) for i in range(n)]
