"""python -m torch_scan_hop.demo: a scanned RNN in eager, its traced graph, and its gradients."""
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import torch_scan_hop

from . import fwd_bwd, scan


def main():
    torch.manual_seed(0)
    w = torch.randn(4, 4, requires_grad=True)  # closed over: lifted into additional_inputs

    def cell(c, x):
        c = torch.tanh(c @ w + x)
        return c, c.sum(-1)

    init, xs = torch.zeros(2, 4), torch.randn(6, 2, 4)
    carry, ys = scan(cell, init, xs)
    ref = init
    for x in xs:
        ref, _ = cell(ref, x)
    print("torch.ops.higher_order.scan is torch_scan_hop.scan_op:", torch.ops.higher_order.scan is torch_scan_hop.scan_op)
    print("final carry matches a Python loop:", torch.allclose(carry, ref))
    print("ys:", tuple(ys.shape))

    carry.sum().backward()
    print("grad of the closed-over weight:", w.grad.norm().item())

    with torch.no_grad():  # inference graph; with grad, the node's body is the partitioned forward
        gm = make_fx(lambda c, xs: scan(cell, c, xs), tracing_mode="fake", _allow_non_fake_inputs=True)(init, xs)
    print("\n== make_fx graph: one scan node ==")
    print(gm.code.strip())
    print("\n== its body ==")
    print(gm.scan_combine_graph_0.code.strip())

    fb = fwd_bwd(cell, init, xs[0])
    print("\n== fwd_bwd: fwd(*carry, *x, *lifted) -> (*new_carry, *y, *saved) ==")
    print(fb.fwd.code.strip())
    print("\n== bwd(*saved, *grad_new_carry, *grad_y) -> (*grad_carry, *grad_x, *grad_lifted) ==")
    print(fb.bwd.code.strip())


if __name__ == "__main__":
    main()
