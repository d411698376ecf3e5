"""Eager overhead of scan vs a hand-written Python loop (and upstream torch's scan).

RNN cell H=64, B=8, T in (16, 256, 1024), default grad mode, nothing requires
grad. Target: scan <= 1.3x the Python loop. Run: python benchmarks/eager_overhead.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _timing import best_time, print_table  # noqa: E402

import torch_scan_hop  # noqa: E402
from torch._higher_order_ops.scan import scan as upstream_scan  # noqa: E402

H, B = 64, 8
torch.manual_seed(0)
W = torch.randn(H, H) / H**0.5


def cell(c, x):
    c = torch.tanh(c @ W + x)
    return c, c.sum(-1)


def python_loop(c, xs):
    ys = []
    for x in xs:
        c, y = cell(c, x)
        ys.append(y)
    return c, torch.stack(ys)


def upstream_cell(c, x):
    c = torch.tanh(c @ W + x)
    return c, c.sum(-1)


def main():
    torch.set_num_threads(1)
    rows = []
    for T in (16, 256, 1024):
        c0, xs = torch.zeros(B, H), torch.randn(T, B, H)
        number = max(1, 2048 // T)
        t_loop = best_time(lambda: python_loop(c0, xs), number=number)
        t_scan = best_time(lambda: torch_scan_hop.scan(cell, c0, xs), number=number)
        ref, got = python_loop(c0, xs), torch_scan_hop.scan(cell, c0, xs)
        assert torch.allclose(ref[1], got[1])
        row = [T, f"{t_loop * 1e3:.3f}", f"{t_scan * 1e3:.3f}", f"{t_scan / t_loop:.2f}x"]
        if T <= 256:
            t_up = best_time(lambda: upstream_scan(upstream_cell, c0, xs), repeat=3)
            row += [f"{t_up * 1e3:.3f}", f"{t_up / t_loop:.2f}x"]
        else:
            row += ["-", "-"]
        rows.append(row)
    print_table(["T", "loop ms", "scan ms", "scan/loop", "upstream ms", "upstream/loop"], rows)


if __name__ == "__main__":
    main()
