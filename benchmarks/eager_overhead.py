"""Eager overhead of scan vs a hand-written Python loop (and upstream torch's scan).

RNN cell H=64, B=8, T in (1, 16, 256, 1024), one thread. No grad: default grad mode,
nothing requires grad. Train (``--train``): W requires grad, one forward + backward.
Targets (issue 35): no grad <= 1.1x the loop at T=16, <= 1.05x at T=256.

The box these run on is shared, so each variant is timed with ``time.thread_time``
(CPU time of this thread: another process's load does not count, its cache pressure
still does) in rounds that alternate the order of loop and scan; the ratio column is
the median over rounds of scan/loop timed in the same round, with the rounds'
interquartile range: a ratio is only as good as that range is narrow.

Run: python benchmarks/eager_overhead.py [--train] [--rounds N]
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _timing import best_time, print_table
from torch._higher_order_ops.scan import scan as upstream_scan

import torch_scan_hop

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


def paired_rounds(fns, rounds, number):
    """Per-call CPU seconds of each fn in every round (order alternating per round)."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    order = list(fns)
    for _ in range(rounds):
        for name in order:
            t0 = time.thread_time()
            for _ in range(number):
                fns[name]()
            times[name].append((time.thread_time() - t0) / number)
        order.reverse()
    return times


def ratio_cells(a, b):
    """min(a) / min(b), and the median [quartiles] of the per-round a/b."""
    r = sorted(x / y for x, y in zip(a, b))
    q = len(r) // 4
    return f"{min(a) / min(b):.3f}x", f"{statistics.median(r):.3f}x [{r[q]:.2f}, {r[-1 - q]:.2f}]"


def train_step(run):
    def step():
        c, ys = run()
        (c.sum() + ys.sum()).backward()
        W.grad = None
    return step


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", action="store_true", help="forward + backward, W requires grad")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    W.requires_grad_(args.train)
    rows = []
    for T in (1, 16, 256, 1024):
        c0, xs = torch.zeros(B, H), torch.randn(T, B, H)
        ref, got = python_loop(c0, xs), torch_scan_hop.scan(cell, c0, xs)
        assert torch.allclose(ref[1], got[1]) and torch.allclose(ref[0], got[0])
        loop = lambda c0=c0, xs=xs: python_loop(c0, xs)
        ours = lambda c0=c0, xs=xs: torch_scan_hop.scan(cell, c0, xs)
        if args.train:
            loop, ours = train_step(loop), train_step(ours)
        number = max(1, 512 // T)
        rounds = args.rounds if T <= 256 else max(5, args.rounds // 4)
        times = paired_rounds({"loop": loop, "scan": ours}, rounds, number)
        row = [T, f"{min(times['loop']) * 1e3:.4f}", f"{min(times['scan']) * 1e3:.4f}",
               *ratio_cells(times["scan"], times["loop"])]
        if T <= 256 and not args.train:
            t_up = best_time(lambda c0=c0, xs=xs: upstream_scan(upstream_cell, c0, xs), repeat=3)
            row += [f"{t_up / min(times['loop']):.2f}x"]
        else:
            row += ["-"]
        rows.append(row)
    print(f"{'train step' if args.train else 'no grad'}, thread CPU time, {args.rounds} rounds")
    print_table(["T", "loop ms", "scan ms", "scan/loop (min)", "scan/loop per round: median [IQR]",
                 "upstream/loop"], rows)


if __name__ == "__main__":
    main()
