"""Which stacked container a layer's parameters belong to, and whether they still are its rows.

The low floor of the layer-stack package: ``storage`` (the containers),
``grads``, ``intact`` and ``checks`` all ask it, and it asks none of them.
A stacked container carries a token (an int, so code that runs at trace time
finds the container by it and Dynamo guards on it as a constant), and a
parameter-registration hook notices ``layer.weight = nn.Parameter(...)`` on a
stacked layer: the stack then no longer holds that weight (``BROKEN``), and
``scan_layers`` falls back to stacking per call.
"""
import itertools
import weakref

import torch

BROKEN = "_scan_stack_broken"


class Stacked:
    """Marker base of the containers ``stack_layers`` returns (``storage._StackedMixin``)."""


def is_row(p, P, i):
    try:
        return (p.device == P.device and p.dtype == P.dtype and p.shape == P.shape[1:]
                and p.untyped_storage().data_ptr() == P.untyped_storage().data_ptr()
                and p.storage_offset() == P.storage_offset() + i * P.stride(0)
                and p.stride() == P.stride()[1:])
    except (RuntimeError, NotImplementedError):  # no storage to compare (XLA, fake): trust the flag
        return True


def layers_hold_stack_parameters(layers):
    """``layers_hold_their_parameters`` without the pointer checks (what Dynamo traces
    where its tracker cannot answer from the real objects)."""
    d = layers.__dict__
    return layers_hold_their_parameters(list(layers), d["_scan_ids"], d["_scan_fed"], check_rows=False)


def layers_hold_their_parameters(mods, ids, stacked, check_rows):
    """Every layer still holds the Parameter objects that are the stack's rows,
    not tensors swapped in by ``torch.func.functional_call`` (in any layer) or assigned
    (and, with ``check_rows``, they still view their rows of ``stacked``).
    Read through the layers' own ``_modules`` / ``_parameters`` (the paths the model's code
    reads: guards Dynamo skips while those dicts are unchanged), compared by ``id`` with
    ints: comparing with stored objects made one Python aliasing guard per parameter. (A
    tensor made in the traced graph is no Parameter: ``id`` is asked of sourced ones only.)"""
    for name, want in ids.items():
        *path, leaf = name.split(".")
        for i, (m, expected) in enumerate(zip(mods, want)):
            for part in path:  # ``owner_of`` inline: Dynamo traces a call per parameter (~2 ms each)
                m = m._modules.get(part) if m is not None else None
            p = None if m is None else m._parameters.get(leaf)
            if not isinstance(p, torch.nn.Parameter) or id(p) != expected:
                return False
            if check_rows and not is_row(p, stacked[name], i):
                return False
    return True


def owner_of(module, name):
    """``(submodule, leaf)`` holding the dotted parameter ``name`` of ``module``
    (submodule None when a module on the path is gone)."""
    *path, leaf = name.split(".")
    for part in path:
        module = module._modules.get(part)
        if module is None:
            break
    return module, leaf


# --- noticing replaced parameters --------------------------------------------------------

_OWNED = weakref.WeakKeyDictionary()  # a layer's submodule -> weakref to its stacked container
_HOOK = []
TOKEN = "_scan_token"
_TOKENS = itertools.count(1)
_BY_TOKEN = weakref.WeakValueDictionary()


def container_token(layers):
    """A stacked container's token, an int unique to it (None for other containers): code
    that runs at trace time finds the container by it, and Dynamo guards on it as a constant."""
    return layers.__dict__.get(TOKEN) if isinstance(layers, Stacked) else None


def container_of(token):
    return _BY_TOKEN[token]


def track(container):
    token = next(_TOKENS)  # fresh on every restack and copy: a deepcopy must not share its source's
    container.__dict__[TOKEN] = token
    _BY_TOKEN[token] = container
    for where in container.__dict__["_scan_owners"].values():
        for m, _ in where:
            _OWNED[m] = weakref.ref(container)  # weak: the container holds the submodule
    if not _HOOK:
        _HOOK.append(torch.nn.modules.module.register_module_parameter_registration_hook(_on_register))


def _on_register(module, name, param):
    """``layer.weight = nn.Parameter(...)`` (any register_parameter) on a stacked layer: the
    stack no longer holds that weight; scan_layers falls back to stacking per call."""
    ref = _OWNED.get(module)
    container = None if ref is None else ref()
    if container is not None and any(m is module and leaf == name
                                     for where in container.__dict__.get("_scan_owners", {}).values()
                                     for m, leaf in where):
        container.__dict__[BROKEN] = True
