"""torch_xla.experimental's scan keywords (partition_fn, is_fn_pure, is_layer_pure) on ours.

Code written for torch_xla's scan / scan_layers passes these; ours must honour partition_fn as
remat and accept the purity flags, and scan_layers must not hand them to the layers (a layer
taking **kwargs would drop them, and the partitioner would silently never run). Values and
gradients against the plain Python loop, on CPU, and on XLA where torch_xla is installed.
"""
import copy

import pytest
import torch
from conftest import assert_trees_close, reference_scan
from functorch.compile import default_partition, min_cut_rematerialization_partition

from torch_scan_hop import ScanError, scan, scan_layers


def cell(carry, x):
    h = torch.sin(carry) * x + torch.cos(x)
    return h, h.sum(-1)


def counting(partition):
    """A custom partition function (not one of functorch's own objects) that counts its calls."""
    calls = []

    def partition_fn(*args, **kwargs):
        calls.append(1)
        return partition(*args, **kwargs)
    return partition_fn, calls


def scan_vs_loop(device, **kwargs):
    torch.manual_seed(0)
    init = torch.randn(3, 4, device=device)
    xs = torch.randn(5, 3, 4, device=device)
    grads = []
    for run in (lambda i, x: scan(cell, i, x, **kwargs), lambda i, x: reference_scan(cell, i, x)):
        i, x = init.clone().requires_grad_(), xs.clone().requires_grad_()
        out = run(i, x)
        g = torch.autograd.grad(out[0].sum() + (out[1] * 2).sum(), (i, x))
        grads.append([t.cpu() for t in (out[0], out[1], *g)])
    assert_trees_close(grads[0], grads[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("partition_fn", [default_partition, min_cut_rematerialization_partition],
                         ids=["default_partition", "min_cut"])
def test_scan_partition_fn_matches_loop(partition_fn):
    scan_vs_loop("cpu", partition_fn=partition_fn, is_fn_pure=True)


def test_scan_custom_partition_fn_is_used():
    partition_fn, calls = counting(min_cut_rematerialization_partition)
    scan_vs_loop("cpu", partition_fn=partition_fn)
    assert calls, "scan(partition_fn=...) never called the partition function"


class KwargsLayer(torch.nn.Module):
    """Takes **kwargs as Hugging Face layers and torch_xla's decoder example do; records them."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.seen = []

    def forward(self, h, **kwargs):
        self.seen.append(sorted(kwargs))
        return torch.tanh(self.lin(h))


def layers_vs_loop(device, **kwargs):
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(KwargsLayer() for _ in range(3)).to(device)
    loop_layers = copy.deepcopy(layers)
    x = torch.randn(2, 4, device=device)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = scan_layers(layers, xa, **kwargs)
    out.sum().backward()
    ref = xb
    for layer in loop_layers:
        ref = layer(ref)
    ref.sum().backward()
    got = [out, xa.grad, *(p.grad for p in layers.parameters())]
    want = [ref, xb.grad, *(p.grad for p in loop_layers.parameters())]
    assert_trees_close([t.cpu() for t in got], [t.cpu() for t in want], rtol=1e-5, atol=1e-5)
    return layers


def test_scan_layers_takes_torch_xla_keywords_itself():
    partition_fn, calls = counting(min_cut_rematerialization_partition)
    layers = layers_vs_loop("cpu", partition_fn=partition_fn, is_layer_pure=True)
    assert all(seen == [] for layer in layers for seen in layer.seen), [layer.seen for layer in layers]
    assert calls, "scan_layers(partition_fn=...) never called the partition function"


def test_scan_layers_default_partition_is_save_all():
    layers = layers_vs_loop("cpu", partition_fn=default_partition, is_layer_pure=False)
    assert all(seen == [] for layer in layers for seen in layer.seen)


@pytest.mark.parametrize("kwargs, match", [
    (dict(remat="min_cut", partition_fn=default_partition), "not both"),
    (dict(partition_fn="min_cut"), "partition function"),
    (dict(is_fn_pure="yes"), "is_fn_pure must be a bool"),
])
def test_scan_bad_torch_xla_keywords(kwargs, match):
    with pytest.raises(ScanError, match=match):
        scan(cell, torch.zeros(3, 4), torch.zeros(5, 3, 4), **kwargs)


def test_scan_layers_bad_torch_xla_keywords():
    layers = torch.nn.ModuleList(KwargsLayer() for _ in range(2))
    with pytest.raises(ScanError, match="not both"):
        scan_layers(layers, torch.zeros(2, 4), remat="sqrt", partition_fn=default_partition)
    with pytest.raises(ScanError, match="is_layer_pure must be a bool"):
        scan_layers(layers, torch.zeros(2, 4), is_layer_pure=1)


def test_on_xla():
    torch_xla = pytest.importorskip("torch_xla", reason="torch_xla is not installed")
    dev = torch_xla.device()
    scan_vs_loop(dev, partition_fn=min_cut_rematerialization_partition, is_fn_pure=True)
    partition_fn, calls = counting(default_partition)
    layers = layers_vs_loop(dev, partition_fn=partition_fn, is_layer_pure=True, unroll=1)
    assert calls and all(seen == [] for layer in layers for seen in layer.seen)


class Triple(torch.nn.Module):
    """torch_xla's test_tuple_layers module: three inputs, three outputs."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, y, z):
        return self.lin(x).sin(), self.lin(y).cos(), self.lin(z)


def test_scan_layers_one_tuple_for_several_inputs_names_the_fix():
    """torch_xla's scan_layers(layers, (a, b, c)) unpacks the tuple; ours takes scan_layers(layers, a, b, c)."""
    layers = torch.nn.ModuleList(Triple() for _ in range(2))
    inputs = tuple(torch.randn(2, 4) for _ in range(3))
    with pytest.raises(ScanError, match=r"got one tuple of 3; pass them as scan_layers\(layers, \*inputs\)"):
        scan_layers(layers, inputs)
    loop_layers = copy.deepcopy(layers)
    a = [t.clone().requires_grad_() for t in inputs]
    b = [t.clone().requires_grad_() for t in inputs]
    out = scan_layers(layers, *a)
    sum(o.sum() for o in out).backward()
    ref = tuple(b)
    for layer in loop_layers:
        ref = layer(*ref)
    sum(o.sum() for o in ref).backward()
    assert_trees_close([*out, *(t.grad for t in a), *(p.grad for p in layers.parameters())],
                       [*ref, *(t.grad for t in b), *(p.grad for p in loop_layers.parameters())])


class Pair(torch.nn.Module):
    """Takes ONE tuple input and returns one: not refused."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, pair):
        return torch.tanh(self.lin(pair[0]) + pair[1]), pair[1] * 2


def test_scan_layers_one_tuple_for_a_tuple_taking_layer_is_kept():
    layers = torch.nn.ModuleList(Pair() for _ in range(2))
    loop_layers = copy.deepcopy(layers)
    a, b = torch.randn(2, 4), torch.randn(2, 4)
    out = scan_layers(layers, (a, b))
    ref = (a, b)
    for layer in loop_layers:
        ref = layer(ref)
    sum(o.sum() for o in out).backward()
    sum(o.sum() for o in ref).backward()
    assert_trees_close([*out, *(p.grad for p in layers.parameters())],
                       [*ref, *(p.grad for p in loop_layers.parameters())])
