"""A scan whose body runs several nn.Linear layers, trained through upstream's
front end (``torch._higher_order_ops.scan.scan``, whose graphs call our op) and
through ours, eager and under inductor, against the Python loop: the case of
pytorch's ``test_scan_multiple_layers_gradient`` (issue 39, item 3).

Captured by upstream's Dynamo tracker, the scan reached our inductor lowering
with a ShapeEnv that refused the loop index as an unbacked int: the lowering
failed, fullgraph raised and otherwise Dynamo fell back to eager after a whole
inductor compile, per case. Each case compiles once (one forward and one
backward graph) and a second call with new values must not recompile.
"""
import pytest
import torch
from conftest import assert_trees_close, reference_scan
from torch import nn

from torch_scan_hop import scan

LAYERS, B, T, F = 3, 2, 5, 10
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                   reason="needs a CUDA device"))]


class LinearStack(nn.Module):
    """One carry per layer; layer i adds its output to its carry and feeds it on."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(F, F) for _ in range(LAYERS))

    def step(self, hs, x):
        hs = list(hs)
        for i, layer in enumerate(self.layers):
            hs[i] = hs[i] + layer(x)
            x = hs[i]
        # upstream's tracker rejects an output that aliases another one: clones
        return [h.clone() for h in hs], x.clone()


def _front_end(name):
    if name == "ours":
        return scan
    from torch._higher_order_ops.scan import scan as upstream_scan

    return upstream_scan


def _loss_and_grads(run, model, step, init, xs):
    carry, ys = run(step, init, xs)
    loss = ys.square().sum() + sum(c.sin().sum() for c in carry)
    leaves = [*model.parameters(), *init, xs]
    return [loss.detach(), *torch.autograd.grad(loss, leaves)]


def _inputs(device):
    init = [torch.randn(B, F, device=device, requires_grad=True) for _ in range(LAYERS)]
    return init, torch.randn(T, B, F, device=device, requires_grad=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["eager", "inductor"])
@pytest.mark.parametrize("front_end", ["upstream", "ours"])
def test_linear_layers_in_the_body_train_as_the_loop(front_end, mode, device, fresh_dynamo):
    model = nn.Module.to(LinearStack(), device)
    run, step = _front_end(front_end), model.step  # one bound method: Dynamo guards on it
    if mode == "inductor":
        run = torch.compile(run, backend="inductor", fullgraph=True)
    for call in range(2):  # compiled, the second call (new values) reuses the graphs
        init, xs = _inputs(device)  # (upstream's eager front end compiles per call, by design)
        with torch._dynamo.config.patch(error_on_recompile=call > 0 and mode == "inductor"):
            got = _loss_and_grads(run, model, step, init, xs)
        want = _loss_and_grads(reference_scan, model, step, init, xs)
        assert_trees_close(got, want, rtol=1e-4, atol=1e-5)
