"""``layers.attributes``: the per-call test that a stack's layers agree with layer 0 says what
the attribute-by-attribute walk says, whichever path (the plain-values tuple or the walk)
decides a module."""
import math

import pytest
import torch

from torch_scan_hop.layers import attributes


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.act = torch.nn.GELU()
        self.scale = 0.5


def _walk(ref, module):
    """The walk alone, for every module of the tree (no plain-values tuple)."""
    mine, theirs = vars(module), vars(ref)
    if mine.keys() != theirs.keys() or type(module) is not type(ref):
        return False
    hooks, skip = attributes._hook_keys()
    if any(map(mine.get, hooks)) or any(map(theirs.get, hooks)):
        skip = attributes._PER_LAYER_STATE
    if not attributes._walk_agrees(theirs, mine, skip):
        return False
    kids, ref_kids = module._modules, ref._modules
    return kids.keys() == ref_kids.keys() and all(
        (a is None) == (b is None) and (a is None or _walk(b, a)) for a, b in zip(kids.values(), ref_kids.values()))


_NAN = float("nan")
_CHANGES = {
    "none": lambda b: None,
    "float": lambda b: setattr(b, "scale", 0.25),
    "int for float": lambda b: setattr(b, "scale", 1),
    "bool for int": lambda b: setattr(b.lin, "in_features", True),
    "str": lambda b: setattr(b.act, "approximate", "tanh"),
    "training": lambda b: b.act.eval(),
    "new attribute": lambda b: setattr(b, "index", 3),
    "nan, another object": lambda b: setattr(b, "scale", float("nan")),
    "tensor": lambda b: setattr(b, "table", torch.ones(3)),
    "hook": lambda b: b.act.register_forward_pre_hook(lambda m, args: None),
    "non-persistent name": lambda b: b.lin._non_persistent_buffers_set.add("x"),
    "callable": lambda b: setattr(b, "fn", lambda t: t),
    "list": lambda b: setattr(b, "sizes", [1, 2]),
}


@pytest.mark.parametrize("change", sorted(_CHANGES))
def test_agreement_is_the_walks(change):
    ref, other = Block(), Block()
    if change in ("nan, another object",):
        ref.scale = _NAN
    if change in ("tensor", "callable", "list", "new attribute"):  # both have one: equal or not by value
        _CHANGES[change](ref)
    _CHANGES[change](other)
    want = _walk(ref, other)
    assert attributes.tree_agrees(ref, other) is want
    assert attributes.all_attributes_agree([ref, Block(), other]) is (want and _walk(ref, Block()))


def test_equal_values_agree_and_a_changed_one_is_seen_after_agreeing_calls():
    layers = [Block() for _ in range(4)]
    for _ in range(3):
        assert attributes.all_attributes_agree(layers)
    layers[2].scale = 0.25
    assert not attributes.all_attributes_agree(layers)
    layers[2].scale = 0.5
    shared_nan = layers[0].scale = layers[1].scale = layers[2].scale = layers[3].scale = math.nan
    assert shared_nan is layers[3].scale and attributes.all_attributes_agree(layers)  # the same object: identity
    layers[3].scale = float("nan")  # another NaN object: not equal to itself
    assert not attributes.all_attributes_agree(layers)


def test_a_tensor_attribute_never_reaches_equality():
    """A tensor attribute makes the module take the walk (identity only), never ``==``."""
    a, b = Block(), Block()
    a.table = b.table = torch.ones(2)
    assert attributes.tree_agrees(a, b)
    b.table = torch.ones(2)
    assert not attributes.tree_agrees(a, b)
