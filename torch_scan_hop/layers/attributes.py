"""Do a stack's layers agree with layer 0 on every plain attribute of their module trees?

``scan_layers`` asks it on every eager call on XLA (``all_attributes_agree``): when they
agree, the traced body reads no peer layer (``layers.view``'s checks on read, under Dynamo one
guard per layer and attribute read, have nothing to find). Outside Dynamo only: it cannot
enumerate a ``__dict__``. Anything that differs (a per-layer index nobody reads, say) leaves
the checks on read to decide.

It runs per call over every module of every layer: at depth 8 of benchmarks/xla_long.py
(Sequential(Linear, GELU): 21 module pairs, up to 19 attributes each) an attribute-by-attribute
walk cost ~0.17 ms a call, this ~0.115. Most of a module's attributes are its empty hook
containers and its per-layer state, tested together in C; of the rest, values of plain types
(``training``, ``in_features``) are compared as one tuple per module (``_plain_values``), also
in C. A module whose tuple does not match that way (another type, a tensor, a callable, a NaN,
a hook) takes the walk, which decides: the fast test only ever says yes where the walk says yes.
"""
import collections
import functools
import operator

import torch

from .. import _compat
from .layer_state import same_value

_PER_LAYER_STATE = ("_parameters", "_buffers", "_modules")  # compared by layer_states / recursion
_PLAIN_TYPES = (bool, int, float, str, type(None))  # == is value equality (a NaN falls to same_value)
_PLAIN = frozenset(_PLAIN_TYPES)
_CONTAINERS = (dict, collections.OrderedDict, set)  # hook dicts, _non_persistent_buffers_set
_MAX_GETTERS = 4096
_getters = {}  # (module type, attribute names in order) -> their non-skipped values as a tuple


def all_attributes_agree(layers):
    """Every plain attribute in every layer's module tree equals layer 0's."""
    return all(tree_agrees(layers[0], layer) for layer in layers[1:])


@functools.lru_cache(maxsize=None)
def _hook_keys():
    """The containers every module starts with, empty (hooks, the non-persistent buffer names),
    and what ``tree_agrees`` skips when they are empty in both modules."""
    keys = tuple(k for k, v in vars(torch.nn.Module()).items() if type(v) in _CONTAINERS and k not in _PER_LAYER_STATE)
    return keys, frozenset((*keys, *_PER_LAYER_STATE))


def _values_getter(cls, names):
    """A function of a module's ``__dict__``: the tuple of its values other than the hook
    containers and the per-layer state, for modules of type ``cls`` with attributes ``names``."""
    key = (cls, names)
    getter = _getters.get(key)
    if getter is None:
        others = tuple(n for n in names if n not in _hook_keys()[1])
        if len(others) > 1:
            getter = operator.itemgetter(*others)
        else:  # itemgetter of one name returns the value, not a tuple
            getter = functools.partial(_one_or_none, others[0] if others else None)
        if len(_getters) < _MAX_GETTERS:
            _getters[key] = getter
    return getter


def _one_or_none(name, d):
    return () if name is None else (d[name],)


def _plain_values(cls, theirs, mine):
    """Are the values in ``mine`` (a module's ``__dict__``, but hooks and per-layer state) of
    plain types, of the same type as those in ``theirs`` and equal to them? Compared in C: no
    value of another type reaches ``==``."""
    getter = _values_getter(cls, tuple(theirs))
    a, b = getter(theirs), getter(mine)
    types = tuple(map(type, a))
    return types == tuple(map(type, b)) and _PLAIN.issuperset(types) and a == b


def tree_agrees(ref, module):
    mine, theirs = vars(module), vars(ref)
    if mine.keys() != theirs.keys() or type(module) is not type(ref):
        return False
    hooks, skip = _hook_keys()
    # most of a module's attributes are its empty hook containers: tested together, in C
    if any(map(mine.get, hooks)) or any(map(theirs.get, hooks)):
        skip = _PER_LAYER_STATE
    elif _plain_values(type(ref), theirs, mine):
        skip = None  # every attribute compared: only the children are left
    if skip is not None and not _walk_agrees(theirs, mine, skip):
        return False
    kids, ref_kids = _compat.nn.child_modules(module), _compat.nn.child_modules(ref)
    return kids.keys() == ref_kids.keys() and all(
        (a is None) == (b is None) and (a is None or tree_agrees(b, a)) for a, b in zip(kids.values(), ref_kids.values()))


def _walk_agrees(theirs, mine, skip):
    """Attribute by attribute, cheapest tests first; ``skip``: names compared elsewhere."""
    for k, v in theirs.items():
        w = mine[k]
        if w is v or k in skip:
            continue
        t = type(v)
        if t is type(w) and (t in _PLAIN_TYPES and w == v or t in _CONTAINERS and not v and not w):
            continue  # equal plain values, or two empty hook containers (most of a module's attributes)
        if not same_value(w, v):
            return False
    return True
