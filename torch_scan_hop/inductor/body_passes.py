"""Rewrites of a scan body's graph before it becomes a loop body.

A loop body runs T times per call, so what a kernel call costs besides its
arithmetic matters there as it does nowhere else in a graph. These rewrites
trade a fused extern call for a cheaper one where the body's own pointwise
kernel absorbs the difference.
"""
import torch

from .. import _compat

aten = torch.ops.aten


def unfuse_bias_adds(body):
    """``addmm(bias, a, b)`` on the CPU -> ``mm(a, b) + bias`` where every use of the
    result is pointwise (the add then fuses into that use's C++ kernel).

    Inductor's post-grad patterns fuse ``mm + add`` into ``addmm`` on the CPU (on GPUs
    they unfuse it when the users are pointwise, as here). On the CPU ``addmm`` with
    ``beta=1`` first copies the bias into the output and costs ~1 us more per call than
    ``mm`` at small sizes (8x64x64, one thread: 2.9 us against 1.9 us), which in the tanh
    RNN's loop body is a fifth of a step. The fused pointwise kernel reads the bias
    instead. Returns how many were rewritten."""
    rewritten = 0
    for node in list(body.graph.find_nodes(op="call_function", target=aten.addmm.default)):
        if not _is_plain_cpu_addmm(node) or not node.users or not all(_pointwise_use(u) for u in node.users):
            continue
        bias, a, b = node.args
        with body.graph.inserting_before(node):
            mm = body.graph.call_function(aten.mm.default, (a, b))
            add = body.graph.call_function(aten.add.Tensor, (mm, bias))
        mm.meta["val"] = _contiguous_like(node.meta.get("val"))
        add.meta.update(node.meta)
        node.replace_all_uses_with(add)
        body.graph.erase_node(node)
        rewritten += 1
    return _recompiled_if(body, rewritten)


def _is_plain_cpu_addmm(node):
    """alpha = beta = 1, float operands of one dtype on the CPU, a tensor bias."""
    if len(node.args) != 3 or any(node.kwargs.get(k, 1) != 1 for k in ("alpha", "beta")):
        return False
    if set(node.kwargs) - {"alpha", "beta"}:
        return False
    vals = [getattr(a, "meta", {}).get("val") for a in node.args]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return False
    return all(v.device.type == "cpu" and v.dtype == vals[0].dtype and v.dtype.is_floating_point for v in vals)


def _pointwise_use(use):
    """A pointwise op (through views and getitems), where a bias add fuses."""
    if use.op != "call_function":
        return False
    tags = getattr(use.target, "tags", None)  # an OpOverload's
    if tags is None:
        return False
    if getattr(use.target, "is_view", False):
        return bool(use.users) and all(_pointwise_use(u) for u in use.users)
    return torch.Tag.pointwise in tags


def copy_slices_into_unfaked_ops(body, num_carry, num_xs):
    """Give an op with no Meta (or composite) kernel a contiguous copy of each ``x`` slice it reads.

    In the loop each ``x`` is ``xs.select(0, i)`` at the loop index ``i``: a view whose
    storage offset is symbolic. FakeTensor knows an op without a Meta kernel only by running
    its real kernel on zeros, and refuses to when an input's strides or offset are symbolic:
    e.g. ``nn.GRUCell`` on CUDA (``aten._thnn_fused_gru_cell`` and its backward, which reads a
    saved workspace row) failed to compile with ``UnsupportedOperatorException``, while the
    compiled Python loop ran. A copy has offset 0; it costs one row copy per step, for these
    ops only. Returns how many copies were inserted."""
    placeholders = body.graph.find_nodes(op="placeholder")
    slices = set(placeholders[num_carry:num_carry + num_xs])
    copies = 0
    for node in list(body.graph.nodes):
        if node.op != "call_function" or not _compat.is_op_overload(node.target):
            continue
        if _has_meta_kernel(node.target) or _compat.op_schema(node.target).is_mutable:
            continue
        for arg in {a for a in node.all_input_nodes if _root_of_views(a) in slices}:
            with body.graph.inserting_before(node):
                copy = body.graph.call_function(aten.clone.default, (arg,),
                                                {"memory_format": torch.contiguous_format})
            copy.meta["val"] = _contiguous_like(arg.meta.get("val"))
            node.replace_input_with(arg, copy)
            copies += 1
    return _recompiled_if(body, copies)


def _has_meta_kernel(op):
    """FakeTensor can run ``op`` without its real kernel: it has a Meta kernel, or a composite
    one (views, most ops defined by others). Without either, FakeTensor runs the real kernel
    on zeros, and refuses to when an input has a symbolic stride or offset (GRUCell's
    ``aten._thnn_fused_gru_cell`` on CUDA, ``aten._standard_gamma_grad``).

    ``_compat.has_kernel_for`` reads the registered kernels, not the computed table, which also
    counts fallbacks that raise."""
    name = op.name()
    return any(_compat.has_kernel_for(name, key) for key in _FAKE_CAPABLE_KEYS)


_FAKE_CAPABLE_KEYS = ("Meta", "CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional",
                      "CompositeImplicitAutograd")


def _contiguous_like(val):
    """A new node's example value: a contiguous fake tensor shaped like ``val``."""
    return val.new_empty(val.shape) if isinstance(val, torch.Tensor) else val


def _recompiled_if(body, changes):
    if changes:
        body.graph.lint()
        body.recompile()
    return changes


def _root_of_views(node):
    while node.op == "call_function" and getattr(node.target, "is_view", False) and node.args:
        node = node.args[0]
    return node
