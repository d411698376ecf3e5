"""torch.func through scan: vmap, per-sample gradients and Hessian-vector products.

(Not named functorch.py: a script of that name beside the others would shadow
the functorch package for every benchmark run from this folder.)

RNN cell H=32, T=32, batch 16, CPU, one thread. Rows:
- vmap(scan) vs a Python loop over the batch and vs vmap of the Python loop
  (the same batched ops, so ~1.0x is the target).
- per-sample gradients: vmap(grad(scan)) vs grad per sample in a loop.
- Hessian-vector product (double backward) through scan vs through the loop.
Run: python benchmarks/func_transforms.py
"""
import os
import sys

import torch
from torch.func import grad, vmap

sys.path.insert(0, os.path.dirname(__file__))
from _rnn import cell, run_loop  # noqa: E402
from _timing import interleaved_best_times, print_table  # noqa: E402

from torch_scan_hop import scan  # noqa: E402

H, T, BATCH = 32, 32, 16


def loss_scan(w, c0, xs):
    c, ys = scan(cell(w), c0, xs)
    return c.pow(2).sum() + ys.sum()


def loss_loop(w, c0, xs):
    c, ys = run_loop(w, c0, xs)
    return c.pow(2).sum() + ys.sum()


def hvp(loss, w, c0, xs, v):
    w = w.detach().requires_grad_()
    (g,) = torch.autograd.grad(loss(w, c0, xs), w, create_graph=True)
    return torch.autograd.grad((g * v).sum(), w)[0]


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    w = torch.randn(H, H) / H**0.5
    c0s, xss = torch.randn(BATCH, 1, H), torch.randn(BATCH, T, 1, H)
    v = torch.randn(H, H)
    rows = []

    times = interleaved_best_times({
        "ours": lambda: vmap(loss_scan, in_dims=(None, 0, 0))(w, c0s, xss),
        "vmap(loop)": lambda: vmap(loss_loop, in_dims=(None, 0, 0))(w, c0s, xss),
        "loop over batch": lambda: torch.stack([loss_loop(w, c0s[b], xss[b]) for b in range(BATCH)]),
    })
    rows.append(["vmap(scan)", *_cells(times)])

    times = interleaved_best_times({
        "ours": lambda: vmap(grad(loss_scan), in_dims=(None, 0, 0))(w, c0s, xss),
        "vmap(loop)": lambda: vmap(grad(loss_loop), in_dims=(None, 0, 0))(w, c0s, xss),
        "loop over batch": lambda: torch.stack([grad(loss_loop)(w, c0s[b], xss[b]) for b in range(BATCH)]),
    })
    rows.append(["per-sample grads", *_cells(times)])

    times = interleaved_best_times({
        "ours": lambda: hvp(loss_scan, w, c0s[0], xss[0], v),
        "vmap(loop)": lambda: None,
        "loop over batch": lambda: hvp(loss_loop, w, c0s[0], xss[0], v),
    })
    rows.append(["HVP (double backward)", f"{times['ours'] * 1e3:.2f}", "-", "-",
                 f"{times['loop over batch'] * 1e3:.2f}", f"{times['ours'] / times['loop over batch']:.2f}x"])
    print_table(["case", "scan ms", "vmap(loop) ms", "scan/vmap(loop)", "loop ms", "scan/loop"], rows)


def _cells(times):
    ours, vloop, loop = times["ours"], times["vmap(loop)"], times["loop over batch"]
    return [f"{ours * 1e3:.2f}", f"{vloop * 1e3:.2f}", f"{ours / vloop:.2f}x", f"{loop * 1e3:.2f}", f"{ours / loop:.2f}x"]


if __name__ == "__main__":
    main()
