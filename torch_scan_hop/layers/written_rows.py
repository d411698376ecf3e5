"""Per-layer state that each layer writes: a layer's KV cache in a scanned stack.

A cache that each layer updates in place (its own slot, picked by ``layer_idx``) cannot be a
keyword input of one scanned body: the body is layer 0's code, so every step would write
layer 0's slot, and a traced scan writes nothing in place. A ``WrittenRows`` keyword input
(one per layer, built by the caller: ``models.stacked_cache`` for transformers' static cache)
stands for such state functionally: its tensors are that layer's rows, stacked over the layers
and sliced per step like any per-layer tensor input; the layer calls its methods, which
compute the new rows out of place; the step returns them as extra ys, and after the scan each
layer's own object takes its row of them (``take``), e.g. copies it into its cache.
Eager loops call the layers with the objects themselves and then hand each its own writes.
"""
import torch

from .. import _compat
from ..core.trees import ScanError


class WrittenRows:
    """A per-layer keyword input that the layer reads and writes (subclass it).

    ``rows()``: the tensors it reads (a tuple); ``over(rows)``: a new one of the same kind over
    other rows (one step's slices); ``written()``: its rows after the layer ran (new tensors,
    ``rows()`` when nothing was written); ``take(rows)``: this layer's rows after the scan.
    ``selects``: names of module attributes the layer reads only to pick its slot of this
    state (``layer_idx``), which differ per layer; the rows already are that slot, so a scanned
    body may read layer 0's (they are not compared across the layers)."""

    selects = ()

    def rows(self):
        raise NotImplementedError

    def over(self, rows):
        raise NotImplementedError

    def written(self):
        raise NotImplementedError

    def take(self, rows):
        raise NotImplementedError


def _is_written_rows(x):
    return isinstance(x, WrittenRows)


_MARK = "torch_scan_hop.written_rows"  # the one key of the dict that stands for one in the keywords


def _marked(x):
    return isinstance(x, dict) and len(x) == 1 and _MARK in x


def as_rows(per_layer):
    """``(per_layer, slots)``: the keyword dicts with each ``WrittenRows`` replaced by a dict
    ``{_MARK: its rows}`` (stacked and sliced as any per-layer tensors), and the objects
    themselves, one list per layer in a fixed order (empty lists when there are none)."""
    plain, slots, last = [], [], None
    traced = _compat.is_dynamo_compiling()  # Dynamo cannot trace ``is`` between two dicts
    for kwargs in per_layer:
        # one dict for every layer (the broadcast keywords, the usual call): walked once, not per
        # layer (a pytree walk of even an empty dict cost ~10 us: 0.7 ms a call at depth 64)
        if traced and _plain_tree(kwargs):  # no WrittenRows can hide in it: no pytree walk to trace
            plain.append(kwargs)
            slots.append([])
            continue
        if traced or last is None or kwargs is not last[0]:
            leaves, spec = _compat.pytree.tree_flatten(kwargs, is_leaf=_is_written_rows)
            objects = [leaf for leaf in leaves if _is_written_rows(leaf)]
            leaves = [{_MARK: tuple(leaf.rows())} if _is_written_rows(leaf) else leaf for leaf in leaves]
            last = (kwargs, _compat.pytree.tree_unflatten(leaves, spec), objects)
        plain.append(last[1])
        slots.append(list(last[2]))
    _check_one_kind(slots)
    return plain, slots


def _plain_tree(x):
    """Dicts, lists and tuples of tensors, None and plain scalars only. A plain loop, cheap for
    Dynamo to trace: the pytree walk of one layer's keywords cost ~70 ms to trace (~1 s at 16 layers)."""
    if x is None or isinstance(x, (torch.Tensor, bool, int, float, str)):
        return True
    if type(x) is dict:
        x = list(x.values())
    if type(x) in (list, tuple):
        for v in x:
            if not _plain_tree(v):
                return False
        return True
    return False


def _check_one_kind(slots):
    """A scanned step remakes every layer's objects from layer 0's (``at_step``): each must be of
    layer 0's class, or layer 0's update code would run on another kind's rows."""
    for i, objects in enumerate(slots[1:], 1):
        kinds, first = [type(o) for o in objects], [type(o) for o in slots[0]]
        if kinds != first:
            raise ScanError(f"scan_layers: layer {i}'s per-layer state is {[k.__name__ for k in kinds]}, layer 0's "
                            f"{[k.__name__ for k in first]}; layers scanned together need state of one kind "
                            "(e.g. cache layers of one type).")


def at_step(kwargs, template):
    """One step's keywords with each marked dict made a ``WrittenRows`` again (``template``:
    layer 0's objects, in ``as_rows``' order), and those objects (their ``written()`` are the
    step's extra ys)."""
    if not template:
        return kwargs, ()
    leaves, spec = _compat.pytree.tree_flatten(kwargs, is_leaf=_marked)
    made = []
    for pos, leaf in enumerate(leaves):
        if _marked(leaf):
            leaves[pos] = template[len(made)].over(leaf[_MARK])
            made.append(leaves[pos])
    return _compat.pytree.tree_unflatten(leaves, spec), tuple(made)


def hand_back(slots, stacked):
    """After a scan: layer i's objects take row i of the stacked writes."""
    for i, objects in enumerate(slots):
        for obj, rows in zip(objects, stacked):
            obj.take(tuple(r[i] for r in rows))


def settle(kwargs):
    """After a layer ran eagerly with ``kwargs``: each ``WrittenRows`` in them takes its own writes."""
    for leaf in _compat.pytree.tree_leaves(kwargs, is_leaf=_is_written_rows):
        if _is_written_rows(leaf):
            leaf.take(tuple(leaf.written()))


def selecting_reads(template, objects):
    """``{dotted name: True}`` for every attribute of ``template``'s module tree named in the
    ``selects`` of ``objects`` (layer 0's): the reads a scanned body need not compare."""
    names = {name for obj in objects for name in type(obj).selects}
    if not names:
        return {}
    return {f"{prefix}.{name}" if prefix else name: True
            for prefix, module in template.named_modules() for name in names if name in vars(module)}
