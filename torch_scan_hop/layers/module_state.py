"""State a layer keeps on its own modules between calls, in a traced scan: rows in, writes out.

Some layers keep per-call state as plain tensor attributes of their modules, read and
reassigned by ``forward``: RecurrentGemma's recurrent blocks hold their decode state so
(``conv1d_state``; ``rg_lru.recurrent_states``), not in the cache object. The loop over the
layers leaves each layer's attribute as its forward assigned it. A scanned body runs layer 0's
code through a view (``layers.view``) that keeps the body's writes to itself, so, unhelped, it
would read layer 0's tensor for every layer (which the view refuses: ``check_peers_agree``) and
write nothing back.

So in a traced ``scan_layers``: an attribute of the layer's module tree that holds a plain tensor
(not a parameter or buffer) in every layer, alike in shape, dtype and device and not one object
shared by all, is stacked over the layers and scanned as xs (``rows``): the view reads the step's
row, as it reads a buffer's. Not when a row requires grad (a training forward after another left
its states on the modules): the scan's backward would reach every row's old graph, read or not.
Every attribute the body assigns (recorded by the view) is handed back to each layer's module
after the scan, as the loop would leave it (``written``, ``hand_back``): a tensor as the step's
ys (each layer its own row), None (RecurrentGemma assigns None without a cache) as None. (Other
values it assigns stay in the step, as they always did.)

Which attributes to look at: Dynamo cannot enumerate a module's ``__dict__``, so the names come
from outside the trace: ``record`` (``scan_model`` calls it when it prepares a model, and every
scan traced outside Dynamo) notes per module class the public attributes holding None or a plain
tensor; a body traced by Dynamo reads the noted names (``_recorded``, run in Python). An attribute
not noted is read as before: layer 0's, compared with every layer's, a ScanError if it differs.
"""
import torch

from .. import _compat
from ..core.trees import ScanError
from .view import _WRITTEN

_NAMES = {}  # module class -> names of instance attributes seen holding None or a plain tensor


def _candidates(module):
    return tuple(sorted(name for name, value in vars(module).items()
                        if not name.startswith("_") and (value is None or _plain_tensor(value))))


def _plain_tensor(value):
    return isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)


def record(module):
    """Note the candidate attribute names of every module in ``module``'s tree (outside a trace)."""
    for m in module.modules():
        _note(m)


def _note(m):
    names = _candidates(m)
    if names and not set(names) <= set(_NAMES.get(type(m), ())):
        _NAMES[type(m)] = tuple(sorted(set(_NAMES.get(type(m), ())) | set(names)))
    return names


@torch.compiler.assume_constant_result  # run in Python when traced: the names noted outside the trace
def _recorded(cls):
    return _NAMES.get(cls, ())


def _names(module):
    if _compat.is_dynamo_compiling():
        return _recorded(type(module))
    return _note(module)  # noted for a later trace by Dynamo


def _at(layer, prefix):
    """The submodule of ``layer`` at the dotted ``prefix`` ("" for the layer), or None."""
    for part in prefix.split(".") if prefix else ():
        layer = None if layer is None else layer._modules.get(part)
    return layer


def rows(template, layers):
    """``{path: tensor stacked over the layers}`` for the per-layer tensor attributes (above)."""
    out = {}
    for prefix, module in template.named_modules():
        for name in _names(module):
            first = getattr(module, name, None)
            if not _plain_tensor(first):
                continue
            values = [getattr(_at(layer, prefix), name, None) for layer in layers]
            if not all(_plain_tensor(v) and v.shape == first.shape and v.dtype == first.dtype
                       and v.device == first.device for v in values):
                continue  # not rows: the view reads layer 0's and refuses a difference
            if all(v is first for v in values):
                continue  # one tensor for all: the same object is read in every step
            if torch.is_grad_enabled() and any(v.requires_grad for v in values):
                continue  # the scan's backward would reach every row's graph, read or not: left as before
            out[f"{prefix}.{name}" if prefix else name] = torch.stack(values)
    return out


def written(checked):
    """After one step's body: ``{path: value}`` for what it assigned (the view's record in
    ``checked``): tensors (the step's ys) and None (assigned alike in every step: one body). A
    row the body only read is not returned: its layers keep their own tensors, as the loop leaves
    them. Other values it assigns stay in the step, as before (not handed back)."""
    out = {}
    for key, value in checked.items():
        if isinstance(key, tuple) and len(key) == 2 and key[0] == _WRITTEN:
            if value is None or isinstance(value, torch.Tensor):
                out[key[1]] = value
    return out


def hand_back(layers, stacked):
    """After the scan: each layer's module at every assigned path gets its row of the ys (None
    when the body assigned None), as the loop over the layers would have left it."""
    for path, value in stacked.items():
        prefix, _, name = path.rpartition(".")
        for i, layer in enumerate(layers):
            owner = _at(layer, prefix)
            if owner is None:
                raise ScanError(f"scan_layers: layer {i} has no module {prefix!r}, whose attribute {name!r} "
                                "the scanned body assigns.")
            setattr(owner, name, None if value is None else value[i])
