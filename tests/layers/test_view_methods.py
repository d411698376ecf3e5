"""Layer code that inspects its own methods, traced: the methods are bound to the body's view.

BertLayer passes ``self.feed_forward_chunk`` to transformers' ``apply_chunking_to_forward``,
which counts its parameters with ``inspect.signature``. Traced, ``self`` is the view of layer 0
(``layers.view``), so the signature is asked of the view's bound method, under Dynamo too.
"""
import functools
import inspect

import pytest
import torch
from conftest import assert_trees_close
from decoder import run_loop
from torch.fx.experimental.proxy_tensor import make_fx

from torch_scan_hop import scan_layers


def _passes_through(fn):
    """A decorator as transformers' (``deprecate_kwarg``): ``inspect.signature`` follows ``__wrapped__``."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


class CountsItsMethodsParameters(torch.nn.Module):
    """Scales by the parameter counts of two of its methods, as bound methods: 3 and 1 (with
    ``self`` counted, or a wrapper's ``*args, **kwargs`` seen, the values change); calls a
    static method."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def mix(self, h, gate=None, *, scale=1.0):
        return torch.tanh(self.lin(h)) * scale

    @_passes_through
    def shift(self, h):
        return h + 1

    @staticmethod
    def halve(h):  # read through the view as it is: no self to bind
        return h / 2

    def forward(self, h):
        n = len(inspect.signature(self.mix).parameters)
        m = len(inspect.signature(self.shift).parameters)
        return self.halve(self.shift(self.mix(h, scale=float(n))) * m)


@pytest.mark.parametrize("mode", ["compile", "make_fx"])
def test_inspect_signature_of_a_method_in_the_body(mode):
    layers = torch.nn.ModuleList(CountsItsMethodsParameters() for _ in range(3))
    h = torch.randn(2, 3, requires_grad=True)
    fn = lambda h: scan_layers(layers, h)  # noqa: E731
    torch._dynamo.reset()
    run = torch.compile(fn, backend="aot_eager", fullgraph=True) if mode == "compile" else make_fx(fn)(h.detach())

    def value_and_grads(f):
        out = f(h)
        return out, torch.autograd.grad(out.pow(2).sum(), [h, *layers.parameters()])

    want = value_and_grads(lambda h: run_loop(layers, h))
    if mode == "make_fx":  # a graph of values: compared forward only
        assert_trees_close(run(h), want[0])
    else:
        assert_trees_close(value_and_grads(run), want)
