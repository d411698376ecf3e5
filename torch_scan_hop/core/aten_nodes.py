"""What an ATen call in a traced graph does to its inputs, for the passes that rewrite graphs
(inductor's and XLA's row writes ask the same question of a buffer's users)."""
import torch

from .. import _compat

# identities on values (autograd apart): a graph that builds no autograd state (a joint, a
# backward) may read through them, and unread they compute nothing
VALUE_IDENTITIES = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


def makes_new_tensor(node):
    """A call of an ATen op that neither views nor mutates its inputs (its result is its own)."""
    target = node.target
    if node.op != "call_function" or not _compat.is_op_overload(target):
        return False
    schema = _compat.op_schema(target)
    return not target.is_view and not schema.is_mutable \
        and not any(r.alias_info is not None for r in schema.returns)
