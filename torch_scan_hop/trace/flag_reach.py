"""Which outputs of one step would require grad with fewer carries requiring grad, read off
the autograd graph of a single trace instead of another trace per carry-flag state.

The loop's requires-grad flags step by step (``joint.FlagOrbit``) need the step's output
flags for each carry-flag state the loop passes through: a training scan from a fresh
carry passes through init's (nothing carried requires grad) and then its fixed point.
Each state was one more make_fx trace of the body (xla_compile.py's training first call
at N=10: ~15 ms of its ~110 ms of Python, with lazy graphs). The joint is traced with
every floating carry requiring grad (an upper bound of every state), and for each output
the trace records which leaves its autograd graph reaches. Autograd makes a result require
grad exactly when an input does, so with carries C requiring grad an output requires grad
iff its graph reaches a leaf that still requires grad: a carry in C, or any other (an x, a
closure, a leaf the body made), whose flags do not depend on the carries'.

That holds only for a body whose run does not depend on the flags themselves, so the
reading is refused (None: the flags are traced as before) when the body read a tensor's
autograd state (``requires_grad``, ``is_leaf``, ``grad_fn``, ``grad``), acted on it
(``register_hook``, ``retain_grad``, ``requires_grad_``, ``backward``, ``autograd.grad``:
each may fail or differ when the tensor does not require grad), or when its graph holds a
custom ``autograd.Function`` (its forward sees ``ctx.needs_input_grad``).
"""
import torch
from torch.overrides import TorchFunctionMode

# a tensor's autograd state: read (attribute getters) or acted on (methods and functions)
_GETTERS = frozenset({"requires_grad", "is_leaf", "grad_fn", "grad", "retains_grad", "_backward_hooks",
                      "_post_accumulate_grad_hooks", "output_nr"})
_ACTIONS = frozenset({"register_hook", "register_post_accumulate_grad_hook", "retain_grad", "requires_grad_",
                      "backward", "grad", "detach_"})


class FlagWatch(TorchFunctionMode):
    """While a body runs: did it read or act on any tensor's autograd state (``read``)?"""

    def __init__(self):
        super().__init__()
        self.read = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.read and _touches_autograd_state(func):
            self.read = True
        return func(*args, **(kwargs or {}))


def _touches_autograd_state(func):
    name = getattr(func, "__name__", None)
    if name == "__get__":  # an attribute read: the descriptor's own name
        return getattr(getattr(func, "__self__", None), "__name__", None) in _GETTERS
    return name in _ACTIONS


class Reach:
    """Per output of one traced step: None (it does not require grad, nor would it with fewer
    carries requiring grad), or (the carries whose leaves its autograd graph reaches, whether
    it reaches any other leaf)."""

    def __init__(self, outs, carries):
        index = {id(c): i for i, c in enumerate(carries)}
        self.state = tuple(isinstance(c, torch.Tensor) and c.requires_grad for c in carries)
        self.per_output, self.custom_function = [], False
        for o in outs:
            if not isinstance(o, torch.Tensor) or not o.requires_grad:
                self.per_output.append(None)
                continue
            self.per_output.append(self._leaves(o, index))

    def _leaves(self, o, index):
        if o.grad_fn is None:  # a leaf itself
            return (frozenset({index[id(o)]}), False) if id(o) in index else (frozenset(), True)
        carries, other, seen, stack = set(), False, set(), [o.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if isinstance(node, torch.autograd.function.BackwardCFunction):
                self.custom_function = True
            variable = getattr(node, "variable", None)  # an AccumulateGrad: its leaf
            if isinstance(variable, torch.Tensor):
                if id(variable) in index:
                    carries.add(index[id(variable)])
                else:
                    other = True
            stack.extend(nxt for nxt, _ in node.next_functions)
        return frozenset(carries), other

    def covers(self, carry_flags):
        """Whether ``carry_flags`` asks no carry to require grad that the trace did not."""
        return all(s or not f for f, s in zip(carry_flags, self.state))

    def outputs(self, carry_flags):
        """The outputs' requires_grad with the carries requiring grad as ``carry_flags``
        (no more than the traced state's)."""
        return [r is not None and (r[1] or any(carry_flags[i] for i in r[0])) for r in self.per_output]


def reach_or_none(outs, carries, watch):
    """``Reach`` of this step's outputs, or None where the flags cannot be read off (see above)."""
    if watch.read:
        return None
    reach = Reach(outs, carries)
    return None if reach.custom_function else reach
