"""What every step's output must satisfy, checked alike on every path, with one message each.

A body's carry keeps init's structure, shape, dtype and kind (Tensor or DTensor); it returns a
pair ``(new_carry, y)`` whose leaves are tensors; traced, it writes into none of its inputs.
The front end checks the user's pytrees (``check_carry``), the op's rules its flat lists
(``check_flat_carry``: ``scan_op`` called directly, Dynamo's and graph bodies); both name the
leaf by its path and say the same thing, so a mistake reads the same whichever path met it.
The mutation message is shared by the graph check here, the functionalized and Dynamo paths and
``scan_op``'s schema (``trace/body_checks.py`` traces a body for it).
"""
import torch

from .. import _compat
from .dtensors import is_dtensor
from .trees import LEAF, ScanError, ScanInputs, _leaf_paths, flatten, require_tensor_leaves


def check_pair(out):
    """``fn`` returned ``(new_carry, y)``."""
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        got = type(out).__name__ + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else "")
        raise ScanError(
            f"scan: fn must return a pair (new_carry, y), but it returned a {got}; "
            "return (carry, None) if there is no per-step output."
        )
    return out


def check_carry(new_carry, inputs: ScanInputs):
    """The carry fn returns must match init in structure, shape and dtype."""
    if type(new_carry) is torch.Tensor and inputs.init_spec is LEAF:  # a bare tensor carry, the common case
        old = inputs.init_leaves[0]
        if type(old) is torch.Tensor and new_carry.dtype == old.dtype and new_carry.shape == old.shape:
            return [new_carry]
    leaves, spec = flatten(new_carry)
    if spec is not inputs.init_spec and spec != inputs.init_spec:  # identical: a bare tensor carry
        got = _leaf_paths(new_carry, "carry")
        missing = [p for p in inputs.init_paths if p not in got]
        extra = [p for p in got if p not in inputs.init_paths]
        hint = f" (missing: {missing}, unexpected: {extra})" if (missing or extra) else ""
        raise ScanError(
            "scan: the carry returned by fn has a different pytree structure than init"
            f"{hint}: init is {inputs.init_spec}, fn returned {spec}. fn must return a carry "
            "with exactly init's structure."
        )
    require_tensor_leaves(new_carry, "carry", "returned carry", leaves)
    check_carry_meta(leaves, inputs)
    return leaves


def check_flat_carry(init, new_carry):
    """The op's flat carry: the front end's check and messages, leaf ``i`` named ``carry[i]``."""
    if len(new_carry) != len(init):
        raise ScanError(f"scan: the body returned {len(new_carry)} carry leaves for {len(init)} init leaves.")
    require_tensor_leaves(list(new_carry), "carry", "returned carry")
    check_leaves_match(new_carry, init, [f"carry[{i}]" for i in range(len(init))])


def check_carry_meta(leaves, inputs: ScanInputs):
    check_leaves_match(leaves, inputs.init_leaves, inputs.init_paths)


def _same_shape(a, b):
    """Shapes equal; symbolic sizes are compared outside any trace (an outer
    trace's sizes are not tracked by the body's sub-trace)."""
    if all(type(d) is int for d in (*a, *b)):
        return a == b
    with _compat.disable_proxy_modes_tracing():
        return len(a) == len(b) and all(bool(x == y) for x, y in zip(a, b))


def _kind(t):
    return "a DTensor" if is_dtensor(t) else "a torch.Tensor"


def check_leaves_match(leaves, init_leaves, paths):
    """Each new carry leaf keeps its init leaf's kind, shape and dtype (``paths`` name them)."""
    for k, (new, old) in enumerate(zip(leaves, init_leaves)):
        if type(new) is torch.Tensor is type(old) and new.dtype == old.dtype and new.shape == old.shape:
            continue  # plain eager tensors (int sizes), the common case: nothing else to ask
        if is_dtensor(new) != is_dtensor(old):
            raise ScanError(
                f"scan: the carry leaf {paths[k]} is {_kind(old)} in init but fn returned "
                f"{_kind(new)}; a carry keeps its type across the step (make init a DTensor, or return "
                ".to_local() / .full_tensor() where init is a torch.Tensor)."
            )
        if not _same_shape(new.shape, old.shape) or new.dtype != old.dtype:
            what = []
            if not _same_shape(new.shape, old.shape):
                what.append(f"shape {tuple(new.shape)} vs init's {tuple(old.shape)}")
            if new.dtype != old.dtype:
                what.append(f"dtype {new.dtype} vs init's {old.dtype}")
            raise ScanError(
                f"scan: the carry leaf {paths[k]} changed across an iteration: {' and '.join(what)}. "
                "The carry fn returns must keep init's shape and dtype (cast or reshape it, "
                "or change init)."
            )


def flatten_y(y):
    """The y leaves of one step (tensors, None for no value) and their spec."""
    leaves, spec = flatten(y)
    require_tensor_leaves(y, "y", "y", leaves)
    return leaves, spec


# ---------------------------------------------------------------- mutation of the body's inputs

def input_name(i, num_carry, num_x):
    """The body's flat input ``i`` as the user knows it."""
    if i < num_carry:
        return f"carry leaf {i}"
    if i < num_carry + num_x:
        return f"x leaf {i - num_carry}"
    return f"closed-over tensor {i - num_carry - num_x} (additional_inputs)"


def mutation_message(names):
    return (f"scan: fn mutates its input in place ({names}). A traced scan takes writes into the carry "
            "as the new carry, and writes into a closed-over tensor as the loop leaves them (make_fx, "
            "non-strict export, XLA); it cannot write into an x slice (a view of xs), nor, under "
            "torch.compile, into a closed-over tensor: write into a copy (x = x.clone()), or carry the "
            "tensor and use the final carry.")


def check_graph_mutation(gm, num_carry, num_x):
    """Raise if the traced body ``gm`` writes into one of its inputs."""
    mutated, _ = _compat.input_mutations_and_outputs(gm)
    if mutated:
        raise ScanError(mutation_message(", ".join(input_name(i, num_carry, num_x) for i in mutated)))
