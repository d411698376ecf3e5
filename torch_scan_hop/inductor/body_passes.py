"""Rewrites of a scan body's graph before it becomes a loop body.

A loop body runs T times per call, so what a kernel call costs besides its
arithmetic matters there as it does nowhere else in a graph. These rewrites
trade a fused extern call for a cheaper one where the body's own pointwise
kernel absorbs the difference.
"""
import torch

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
        val = node.meta.get("val")
        mm.meta["val"] = val.new_empty(val.shape) if val is not None else None
        add.meta.update(node.meta)
        node.replace_all_uses_with(add)
        body.graph.erase_node(node)
        rewritten += 1
    if rewritten:
        body.graph.lint()
        body.recompile()
    return rewritten


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
