"""DTensor (``torch.distributed.tensor``): a traced scan over DTensors is a scan over their local tensors.

In eager the op is the loop over the DTensors themselves (each step's collectives
run as in a for loop). Traced (torch.compile, make_fx) this rule runs before
dispatch (``hop.SUBCLASS_RULES``): the Autograd key comes before the Python key
where a subclass rule is found, and the traced autograd rule traces the body's
joint with make_fx, which sees plain tensors only. So:

* every DTensor input becomes its local tensor (``to_local``, differentiable); an xs
  leaf sharded along the scanned dim 0 is first gathered along it (each rank runs
  every step);
* the scan runs ``LocalBody``: it wraps the locals back with their recorded mesh,
  placements and global shape (``from_local``), calls the user's body, and returns
  the outputs' locals. The DTensor ops inside (sharding propagation, the
  collectives of a tensor-parallel layer) trace to local ops and functional
  collectives in the body graph: they run inside every step;
* a carry leaf keeps its layout across the step: a DTensor carry that comes back
  with other placements is redistributed to init's (what the loop's next step
  would compute with them); a carry that stops or starts being a DTensor, or
  changes mesh, is a ScanError naming the leaf and both layouts;
* the results are wrapped again (``from_local``): the final carry with init's
  layout, each ys leaf with its step's layout, a sharded dim shifted by the
  stacked dim 0;
* with dynamic shapes (none along a sharded dim: ``op.dynamo``), the layouts'
  symbolic sizes reach the body as the dims of one more closed-over input, an
  empty tensor (``dt.size_carrier``): the body's own trace can use only sizes it
  gets from its inputs.

Gradients flow through ``to_local`` / ``from_local`` and the scan on the locals.
"""
from ..core import dtensors as dt
from ..core.op_args import example_args
from ..core.trees import ScanError
from .hop import SUBCLASS_RULES, scan_op


class LocalBody:
    """The user's body on local tensors: wraps its DTensor inputs, unwraps its outputs."""

    def __init__(self, combine_fn, layouts, num_carry, carried_sizes=False):
        self.combine_fn, self.layouts, self.num_carry = combine_fn, layouts, num_carry
        self.carried_sizes = carried_sizes  # the last argument is dt.size_carrier's
        self.y_layouts = None

    def __call__(self, *args):
        layouts = self.layouts
        if self.carried_sizes:
            *args, carrier = args
            layouts = dt.with_entries(layouts, carrier)
        wrapped = [a if lay is None else dt.wrap(a, lay) for a, lay in zip(args, layouts)]
        out = list(self.combine_fn(*wrapped))
        nc = self.num_carry
        carry = [self._conform(i, c) for i, c in enumerate(out[:nc])]
        ys = out[nc:]
        self.y_layouts = [dt.layout_of(y) if dt.is_dtensor(y) else None for y in ys]
        return [dt.local(t) for t in (*carry, *ys)]

    def _conform(self, i, new):
        want = self.layouts[i]
        if want is None:
            if dt.is_dtensor(new):
                raise ScanError(f"scan: carry leaf {i} is a torch.Tensor in init but the body returned "
                                f"{dt.describe(new)}; a carry keeps its type and placements across the step "
                                "(make init a DTensor laid out so, or return .to_local() / .full_tensor()).")
            return new
        mesh, placements = want[0], want[1]
        if not dt.is_dtensor(new) or new.device_mesh != mesh:
            raise ScanError(f"scan: carry leaf {i} is a DTensor with placements {placements} on {mesh} in "
                            f"init but the body returned {dt.describe(new)}; a carry stays a DTensor on the "
                            "same mesh across the step.")
        if tuple(new.placements) != placements:  # what the loop's next step computes with: redistributed
            new = new.redistribute(mesh, placements)
        return new


def scan_dtensor(combine_fn, init, xs, additional_inputs, *, reverse=False, remat="save_all", unroll=1):
    xs = [dt.unsharded_along_scan(x) if dt.is_dtensor(x) else x for x in xs]
    init_layouts = [dt.layout_of(t) if dt.is_dtensor(t) else None for t in init]
    x_layouts = [dt.sliced(dt.layout_of(x)) if dt.is_dtensor(x) else None for x in xs]
    add_layouts = [dt.layout_of(t) if dt.is_dtensor(t) else None for t in additional_inputs]
    layouts = [*init_layouts, *x_layouts, *add_layouts]
    symbolic = dt.symbolic_entries(layouts)
    body = LocalBody(combine_fn, layouts, len(init), carried_sizes=bool(symbolic))
    local_init, local_xs = [dt.local(t) for t in init], [dt.local(x) for x in xs]
    local_add = tuple(dt.local(t) for t in additional_inputs)
    if symbolic:
        like = dt.first_tensor([*local_init, *local_xs, *local_add])
        local_add += (dt.size_carrier(symbolic, like),)
    out = scan_op(body, local_init, local_xs, local_add, reverse=reverse, remat=remat, unroll=unroll)
    if body.y_layouts is None:  # no rule ran the body (none does so today): learn the ys' layouts
        body(*example_args(local_init, local_xs, local_add))
    nc, length = len(init), xs[0].shape[0]
    carry = [c if lay is None else dt.wrap(c, lay) for c, lay in zip(out[:nc], init_layouts)]
    ys = [y if lay is None else dt.wrap(y, dt.stacked(lay, length)) for y, lay in zip(out[nc:], body.y_layouts)]
    return [*carry, *ys]


if dt.DTensor is not None:
    SUBCLASS_RULES[dt.DTensor] = scan_dtensor
    scan_op.py_impl(dt.DTensor)(scan_dtensor)  # the Python key, should a DTensor reach it below autograd
