"""Whether a call may train: a tensor requiring grad within reach of a body's Python values.

Dynamo's tracker (whether to guess the carries require grad, ``op.carry_grads``) asks it of
what a traced frame holds, before the body is speculated; XLA's eager entry reads closures
with ``cell_contents``.
"""
import torch


def reaches_grad(values, depth):
    """Whether a tensor requiring grad is among ``values``: a tensor, a module's parameter,
    an item of a list, tuple or dict, what a function closes over or a bound method's
    module (``depth`` levels of functions deep: a body made by a function of a function)."""
    for v in values:
        for item in (v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else (v,)):
            if isinstance(item, torch.Tensor) and item.requires_grad:
                return True
            if isinstance(item, torch.nn.Module) and any(p.requires_grad for p in item.parameters()):
                return True
            if depth > 1 and callable(item) and getattr(item, "__closure__", None):
                if reaches_grad(closed_over(item), depth - 1):
                    return True
    return False


def closed_over(fn):
    """What ``fn`` closes over, and its bound ``__self__`` (None where it has none)."""
    return [*(cell_contents(c) for c in getattr(fn, "__closure__", None) or ()), getattr(fn, "__self__", None)]


def cell_contents(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None
