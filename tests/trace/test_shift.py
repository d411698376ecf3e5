"""Which saved carries the backward can rebuild from the previous step (trace/shift.py).

A saved carry input whose step output is a short pointwise recipe of the step's
other saved values (and of closures) is found, with that recipe; anything else
(the carry itself in the recipe, an x slice, a matmul, a random op) is not. The
recipe run on the step's saved values gives the step's new carry.
"""
import pytest
import torch

from torch_scan_hop.trace.partition import partition_body
from torch_scan_hop.trace.shift import find_shifts, previous_rows, worth_it

F = torch.nn.functional


def _shifts(body, carry, x, lifted=()):
    fb = partition_body(body, carry, x, list(lifted), [True] * (len(carry) + len(x) + len(lifted)))
    return fb, find_shifts(fb)


def _check_recipe(fb, shift, carry, x, lifted):
    """The recipe over the forward's saved values reproduces the step's new carry."""
    outs = fb.fwd(*carry, *x, *lifted)
    num_out = fb.num_carry + fb.num_y
    saved = outs[num_out:]
    got = shift.recipe(*(saved[i] for i in shift.leaves), *(lifted[j] for j in shift.lifted))
    torch.testing.assert_close(got, outs[shift.carry])
    assert fb.saved_from[shift.saved] == ("carry", shift.carry)


def test_gelu_layer_is_rebuilt_from_its_pre_activation():
    h, w, b = torch.randn(4, 8), torch.randn(8, 8), torch.randn(8)
    fb, shifts = _shifts(lambda h, w, b: (F.gelu(F.linear(h, w, b)),), [h], [w, b])
    assert len(shifts) == 1 and shifts[0].carry == 0 and shifts[0].lifted == []
    assert [n.target for n in shifts[0].recipe.graph.nodes if n.op == "call_function"] == [torch.ops.aten.gelu.default]
    _check_recipe(fb, shifts[0], [h], [w, b], [])


def test_tanh_rnn_carry_is_the_saved_output_itself():
    c, x, w = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8, 8)
    fb, shifts = _shifts(lambda c, x, w: (torch.tanh(c @ w + x), (c * 2).sum()), [c], [x], [w])
    assert len(shifts) == 1
    assert not [n for n in shifts[0].recipe.graph.nodes if n.op == "call_function"]  # the leaf itself
    _check_recipe(fb, shifts[0], [c], [x], [w])


def test_recipe_may_read_a_closure_and_views():
    c, x, w, s = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8, 8), torch.randn(8)
    fb, shifts = _shifts(lambda c, x, w, s: ((torch.sigmoid(c @ w) * s).reshape(8, 4).t().reshape(4, 8),),
                         [c], [x], [w, s])
    assert len(shifts) == 1 and shifts[0].lifted == [1]
    _check_recipe(fb, shifts[0], [c], [x], [w, s])


def test_two_carries_only_the_rebuildable_one():
    c, d, w = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8, 8)
    # c's output is tanh of a saved matmul; d's output needs d itself (a residual): not rebuilt
    fb, shifts = _shifts(lambda c, d, w: (torch.tanh(c @ w), d + torch.sin(d @ w)), [c, d], [], [w])
    assert [s.carry for s in shifts] == [0]
    _check_recipe(fb, shifts[0], [c, d], [], [w])


def test_dropout_is_rebuilt_from_its_saved_mask():
    """Where the mask is saved for the backward (torch 2.9's partition), the recipe reads it and
    draws nothing; where the partition saves only the inputs (2.11+), there is nothing to rebuild from."""
    c, x, w = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8, 8)
    torch.manual_seed(0)
    fb, shifts = _shifts(lambda c, x, w: (F.dropout(torch.tanh(c @ w), 0.5, training=True),), [c], [x], [w])
    if ("step", None) not in fb.saved_from:
        assert shifts == []
        return
    assert len(shifts) == 1
    assert not any(torch.Tag.nondeterministic_seeded in n.target.tags
                   for n in shifts[0].recipe.graph.nodes if n.op == "call_function")
    _check_recipe(fb, shifts[0], [c], [x], [w])


@pytest.mark.parametrize("name, body", [
    ("residual", lambda c, x, w: (c + torch.tanh(c @ w),)),  # the recipe reads the carry
    ("x_slice", lambda c, x, w: (torch.tanh(c @ w) + x,)),  # and an x slice
    ("matmul", lambda c, x, w: ((torch.tanh(c @ w) @ w),)),  # costly: stays saved
    ("random", lambda c, x, w: (torch.tanh(c @ w) + torch.rand(4, 8),)),  # not saved: drawn again
    ("as_strided", lambda c, x, w: (torch.tanh(c @ w).as_strided((4, 8), (1, 4)),)),  # reads the layout

])
def test_not_rebuilt(name, body):
    c, x, w = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8, 8)
    _, shifts = _shifts(body, [c], [x], [w])
    assert shifts == [], name


@pytest.mark.parametrize("reverse", [False, True])
def test_previous_rows(reverse):
    prev, first = previous_rows(4, reverse, "cpu")
    if reverse:  # steps run 3, 2, 1, 0: step i's carry came from step i + 1
        assert prev.tolist() == [1, 2, 3, 3] and first.tolist() == [False, False, False, True]
    else:
        assert prev.tolist() == [0, 0, 1, 2] and first.tolist() == [True, False, False, False]


@pytest.mark.parametrize("reverse", [False, True])
def test_previous_rows_on_xla_made_once(reverse):
    """On XLA the rows are device data made once per (length, reverse, device) (trace.shift:
    made per call they were a tenth of scan_layers' host time per training step), and fresh
    under a tracer (make_fx: a cached real tensor would be a constant of the graph)."""
    pytest.importorskip("torch_xla", reason="torch_xla is not installed")
    import torch_xla

    dev = torch_xla.device()
    prev, first = previous_rows(5, reverse, dev)
    again = previous_rows(5, reverse, dev)
    assert again[0] is prev and again[1] is first
    expected = previous_rows(5, reverse, "cpu")
    assert prev.device.type == "xla" and prev.cpu().tolist() == expected[0].tolist()
    assert first.cpu().tolist() == expected[1].tolist()
    traced = torch.fx.experimental.proxy_tensor.make_fx(lambda t: previous_rows(5, reverse, t.device)[0] + t)(
        torch.zeros(5, dtype=torch.int64, device=dev))
    assert any(n.target is torch.ops.aten.arange.start_step or "arange" in str(n.target) for n in traced.graph.nodes)


def test_worth_it_from_one_kibibyte_rows():
    assert worth_it(torch.empty(4, 64)) and worth_it(torch.empty(2, 256, dtype=torch.float16))
    assert not worth_it(torch.empty(4, 63)) and not worth_it(torch.empty(4, 8))
    assert not worth_it(None)
