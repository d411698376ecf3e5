"""Pytree bookkeeping and the error messages for bad scan input.

Everything here runs before the loop starts (or on the first step), so a user
mistake is reported in terms of their own pytree paths, not torch internals.
"""
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .. import _compat
from .._compat import pytree


class TreeDef:
    """A pytree spec in which None leaves mean "no value".

    torch's pytree treats None as a leaf; for scan (as in JAX) None is an empty
    subtree, so flat lists hold tensors only and None comes back on unflatten.
    """

    __slots__ = ("spec", "none_mask")

    def __init__(self, spec, none_mask):
        self.spec, self.none_mask = spec, none_mask

    def __eq__(self, other):
        return isinstance(other, TreeDef) and self.none_mask == other.none_mask and self.spec == other.spec

    def __hash__(self):
        return hash(self.none_mask)

    def __repr__(self):
        return repr(pytree.tree_unflatten(["*" if not m else None for m in self.none_mask], self.spec))

    def is_leaf(self):
        return self.spec.is_leaf() and self.none_mask == (False,)

    def unflatten(self, leaves):
        if self is LEAF:  # a bare tensor, the common case: no pytree walk
            return leaves[0]
        it = iter(leaves)
        return pytree.tree_unflatten([None if m else next(it) for m in self.none_mask], self.spec)


LEAF = TreeDef(pytree.tree_structure(0), (False,))


def map_tensors(fn, value):
    """``value`` with ``fn`` applied to its tensors through the containers a carry is
    made of (dicts, namedtuples, tuples, lists), in their order; other leaves as they are."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return type(value)((k, map_tensors(fn, v)) for k, v in value.items())
    if hasattr(value, "_fields"):
        return type(value)(*(map_tensors(fn, v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(fn, v) for v in value)
    return value


def split_counts(seq, *counts):
    """``seq`` cut into consecutive lists of ``counts[0]``, ``counts[1]``, ... items."""
    out, start = [], 0
    for n in counts:
        out.append(list(seq[start:start + n]))
        start += n
    return out


def flatten(tree):
    """(tensor-or-other leaves without the Nones, TreeDef); a bare tensor skips
    pytree, whose node-type lookup alone costs several microseconds."""
    if isinstance(tree, torch.Tensor):
        return [tree], LEAF
    leaves, spec = pytree.tree_flatten(tree)
    mask = tuple(leaf is None for leaf in leaves)
    return [leaf for leaf in leaves if leaf is not None], TreeDef(spec, mask)


def unflatten(leaves, treedef):
    return treedef.unflatten(leaves)


class ScanError(ValueError):
    """Bad input to scan; the message names the leaf and what to do."""


def _leaf_paths(tree, root):
    """Key paths of the non-None leaves, e.g. ``carry['h'][0]``."""
    leaves_with_path, _ = pytree.tree_flatten_with_path(tree)
    return [root + pytree.keystr(p) for p, leaf in leaves_with_path if leaf is not None]


def shape_text(t):
    """``(2, 3)`` for an error message; ``(?, ?)`` under torch.compile, where a size may be
    symbolic (dynamic=True), which Dynamo can neither print nor tell from an int, and a text
    holding one cannot be raised as a ScanError (``op.compile_errors.surface``)."""
    if _compat.is_dynamo_compiling():
        sizes = ["?"] * t.dim()
    else:
        sizes = [str(d) for d in t.shape]
    return "(" + ", ".join(sizes) + ("," if len(sizes) == 1 else "") + ")"


def _describe(v):
    if isinstance(v, torch.Tensor):
        return f"Tensor(shape={shape_text(v)}, dtype={v.dtype})"
    return f"{type(v).__name__} {v!r}"


def require_tensor_leaves(tree, root, what, leaves=None):
    """Paths are computed only on failure: they cost more than the check."""
    leaves = flatten(tree)[0] if leaves is None else leaves
    for leaf in leaves:  # a plain loop: cheaper than all() over a generator for the few leaves of a call
        if not isinstance(leaf, torch.Tensor):
            break
    else:
        return
    for path, leaf in zip(_leaf_paths(tree, root), leaves):
        if not isinstance(leaf, torch.Tensor):
            raise ScanError(
                f"scan: {what} leaf {path} is a {_describe(leaf)}; every {what} leaf must be a "
                f"torch.Tensor (wrap numbers with torch.tensor(...), or use None for no value)."
            )


@dataclass
class ScanInputs:
    """init and xs flattened, validated, with the scan dim moved to 0."""

    init_leaves: list
    init_spec: Any
    xs_leaves: list  # each with the scanned dim at 0 (a dummy one when xs is None)
    xs_spec: Optional[Any]  # None means the user passed xs=None
    length: int

    @property
    def init_paths(self):
        return _leaf_paths(self.init_spec.unflatten(self.init_leaves), "carry")

    @property
    def num_carry(self):
        return len(self.init_leaves)

    @property
    def num_x(self):
        return 0 if self.xs_spec is None else len(self.xs_leaves)


def _check_length(xs, xs_leaves, length, dim):
    lengths = [x.shape[0] for x in xs_leaves]
    if lengths and any(n != lengths[0] for n in lengths):
        xs_paths = _leaf_paths(xs, "xs")
        detail = ", ".join(f"{p}: {n}" for p, n in zip(xs_paths, lengths))
        raise ScanError(
            f"scan: xs leaves have different lengths along dim={dim} ({detail}); "
            "every xs leaf must have the same size along the scanned dim."
        )
    if length is not None and lengths and lengths[0] != length:
        raise ScanError(
            f"scan: length={length} disagrees with xs, whose leaves have size {lengths[0]} "
            f"along dim={dim}; drop length or make them agree."
        )


def _join_xla_device(leaves):
    """CPU leaves move to the XLA device when another leaf is on it.

    A Python loop over mixed inputs works because torch_xla moves a CPU
    operand of each op to the device; the scan is one op on XLA, so its
    inputs move once, up front (differentiably: CPU leaves still get grads).
    """
    xla = next((t.device for t in leaves if t.device.type == "xla"), None)
    if xla is None:
        return leaves
    return [t.to(xla) if t.device.type == "cpu" else t for t in leaves]


def shown(value):
    """``value`` for an error message: a tensor by its shape and dtype (its repr is long, and
    Dynamo cannot trace ``repr`` of a tensor: under ``fullgraph`` the message would be lost)."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {shape_text(value)} and dtype {value.dtype} (pass a Python value)"
    return repr(value)


def prepare_inputs(init, xs, length, dim) -> ScanInputs:
    inputs = _prepare_inputs(init, xs, length, dim)
    n = inputs.num_carry
    joined = _join_xla_device([*inputs.init_leaves, *inputs.xs_leaves])
    inputs.init_leaves, inputs.xs_leaves = joined[:n], joined[n:]
    return inputs


def _prepare_inputs(init, xs, length, dim) -> ScanInputs:
    init_leaves, init_spec = flatten(init)
    require_tensor_leaves(init, "init", "init", init_leaves)
    if length is not None and (not isinstance(length, int) or isinstance(length, bool) or length < 0):
        if not isinstance(length, torch.SymInt):
            raise ScanError(f"scan: length must be a non-negative int, got {shown(length)}.")
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise ScanError(f"scan: dim must be an int, got {shown(dim)}.")
    xs_leaves, xs_spec = flatten(xs)
    if not xs_leaves:
        if length is None:
            raise ScanError(
                "scan: xs is None (or has no tensor leaves) and length is not given; "
                "pass length=N to run fn N times with x=None."
            )
        device = init_leaves[0].device if init_leaves else torch.device("cpu")
        # A zero-width stand-in keeps the op's positional convention (xs carries the length).
        dummy = torch.empty((length, 0), device=device)
        return ScanInputs(init_leaves, init_spec, [dummy], None, length)
    require_tensor_leaves(xs, "xs", "xs", xs_leaves)
    moved = []
    for k, x in enumerate(xs_leaves):
        if x.dim() == 0 or not -x.dim() <= dim < x.dim():
            path = _leaf_paths(xs, "xs")[k]
            raise ScanError(
                f"scan: dim={dim} is out of range for {path} with shape {shape_text(x)} "
                f"({x.dim()} dims); every xs leaf needs the scanned dim."
            )
        moved.append(x if dim in (0, -x.dim()) else torch.movedim(x, dim, 0))
    _check_length(xs, moved, length, dim)
    return ScanInputs(init_leaves, init_spec, moved, xs_spec, moved[0].shape[0])


def own_copy(carry):
    """A copy of a kept carry for a re-run to start from: a body may modify its carry in place
    (the loop allows it where nothing saved the value), which would change the kept carry, or
    raise on a re-run's leaf inside the backward. One copy of the carry per re-run step, small
    next to a body's work; it keeps the autograd link (create_graph)."""
    return map_tensors(torch.Tensor.clone, carry)


def requiring_grad(value, flags):
    """``value`` with the tensors ``flags`` marks (one flag per tensor, in order) requiring grad
    (tensors computed without a tape: a re-run then saves what the forward saved)."""
    flags = iter(flags)
    return map_tensors(lambda t: t.requires_grad_(True) if next(flags) else t, value)
