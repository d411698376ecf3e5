"""What a layer returns, and what ``scan_layers`` returns for it.

Two forms:

- the hidden state itself (the structure of the inputs; or anything but a tuple or a list):
  carried to the next layer, as ever;
- a tuple (or list) whose first element (the first ``n`` for ``n`` positional inputs) has
  the structure, shapes and dtypes of the hidden state, followed by extras, as Hugging Face layers return
  ``(hidden_states, attn_weights, ...)``: the head is carried, each extra is ``None``
  (passed through) or a tensor (or pytree of tensors) stacked along a new leading layer dim.

A tuple that is neither is refused by a ScanError naming the layer and both structures.
"""
import torch

from ..core.trees import ScanError, flatten
from ..op.loop import stack_column


def split_output(out, hidden, n, layers, i):
    """``(carry, extras)`` of one layer's output: ``extras`` is None for the first form, else a tuple.

    ``hidden``: the layer's input hidden state (``n`` positional inputs: the tuple of them);
    ``layers[i]``: the layer, named in the error ("layer 0 (GPT2Block)")."""
    if not isinstance(out, (tuple, list)):
        return out, None
    where = layer_name(layers, i)
    if n > 1:
        out = tuple(out)
    in_def = flatten(hidden)[1]
    if flatten(out)[1] == in_def:
        return out, None
    out = tuple(out)
    head = out[0] if n == 1 and out else out[:n]
    if len(out) < n or not _matches(head, hidden, in_def):
        raise ScanError(
            f"scan_layers: {where} returns {_structure(out)}, which does not match its input {_structure(hidden)}: "
            f"a layer must return the hidden state, or a tuple whose first "
            f"{'element is' if n == 1 else f'{n} elements are'} the hidden state (then carried to the next "
            "layer) followed by tensors or None (returned stacked over the layers).")
    extras = out[n:]
    for k, extra in enumerate(extras):
        if not all(isinstance(leaf, torch.Tensor) for leaf in flatten(extra)[0]):
            raise ScanError(
                f"scan_layers: {where} returns {_structure(out)}; element {n + k} is {_structure(extra)}, but what "
                "follows the hidden state must be tensors or None, to be stacked over the layers "
                "(a cache object: pass use_cache=False).")
    return head, extras


def _matches(head, hidden, in_def):
    """The same structure, and tensors of the same shapes and dtypes, as the hidden state."""
    leaves, treedef = flatten(head)
    return treedef == in_def and all(
        not isinstance(a, torch.Tensor) or (isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype)
        for a, b in zip(leaves, flatten(hidden)[0]))


def join_output(carry, extras, n):
    """What ``scan_layers`` returns: the last hidden state, or the last layer's tuple with every
    extra stacked over the layers (``extras``: the stacked ones, None for the first form)."""
    if extras is None:
        return carry
    return ((carry,) if n == 1 else tuple(carry)) + tuple(extras)


def stack_extras(per_layer, layers):
    """Eager: the layers' extras stacked along a new leading dim; every layer must return layer 0's form."""
    defs = [None if e is None else flatten(e)[1] for e in per_layer]
    for i, d in enumerate(defs[1:], 1):
        if d != defs[0]:
            raise ScanError(
                f"scan_layers: {layer_name(layers, i)} returns {_shown(d)} where layer 0 "
                f"returns {_shown(defs[0])}; every layer must return the same form.")
    if defs[0] is None:
        return None
    columns = zip(*(flatten(e)[0] for e in per_layer))
    return defs[0].unflatten([stack_column(list(c), k) for k, c in enumerate(columns)])


def layer_name(layers, i):
    return f"layer {i} ({type(layers[i]).__name__})"


def _structure(tree):
    """A structure with its tensors as ``Tensor(2, 5, 16)``: ``(Tensor(2, 5, 16), None)``."""
    if isinstance(tree, torch.Tensor):
        return f"Tensor{tuple(tree.shape)}"
    if isinstance(tree, (tuple, list)):
        inner = ", ".join(_structure(t) for t in tree) + ("," if isinstance(tree, tuple) and len(tree) == 1 else "")
        return f"({inner})" if isinstance(tree, tuple) else f"[{inner}]"
    if isinstance(tree, dict):
        return "{" + ", ".join(f"{k!r}: {_structure(v)}" for k, v in tree.items()) + "}"
    return "None" if tree is None else type(tree).__name__


def _shown(treedef):
    return "the hidden state alone" if treedef is None else "extras " + repr(treedef).replace("'*'", "Tensor")
