"""Training step through scan vs a Python loop with autograd, and peak memory per remat policy.

Body: a 4-layer MLP (H=256, batch 64) applied to the carry each step, T=64 steps.
Targets: scan fwd+bwd <= 1.3x the loop; recompute_all peak memory <= 1/3 of save_all.
Run: python benchmarks/backward.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _timing import best_time, print_table  # noqa: E402

from torch_scan_hop import scan  # noqa: E402

H, B, T, LAYERS = 256, 64, 64, 4


def make_model():
    torch.manual_seed(0)
    return torch.nn.ModuleList(torch.nn.Linear(H, H) for _ in range(LAYERS))


def body_for(mlp):
    def body(c, x):
        h = c + x
        for lin in mlp:
            h = torch.tanh(lin(h))
        return h, h.mean(-1)
    return body


def loop_step(mlp, c, xs):
    body = body_for(mlp)
    ys = []
    for x in xs:
        c, y = body(c, x)
        ys.append(y)
    (c.sum() + torch.stack(ys).sum()).backward()


def scan_step(mlp, c, xs, remat):
    c, ys = scan(body_for(mlp), c, xs, remat=remat)
    (c.sum() + ys.sum()).backward()


def peak_bytes(fn):
    """Peak CPU memory allocated during fn, from torch's profiler memory events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live, peak = 0, 0
    for ev in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += ev.cpu_memory_usage
        peak = max(peak, live)
    return peak


def main():
    torch.set_num_threads(max(1, torch.get_num_threads()))
    mlp = make_model()
    c0, xs = torch.zeros(B, H), torch.randn(T, B, H)
    t_loop = best_time(lambda: loop_step(mlp, c0, xs), repeat=3)
    m_loop = peak_bytes(lambda: loop_step(mlp, c0, xs))
    rows = [["python loop", f"{t_loop * 1e3:.1f}", "1.00x", f"{m_loop / 2**20:.1f}", "-"]]
    m_save_all = None
    for remat in ("save_all", "min_cut", "recompute_all"):
        t = best_time(lambda: scan_step(mlp, c0, xs, remat), repeat=3)
        m = peak_bytes(lambda: scan_step(mlp, c0, xs, remat))
        m_save_all = m_save_all or m
        rows.append([f"scan {remat}", f"{t * 1e3:.1f}", f"{t / t_loop:.2f}x", f"{m / 2**20:.1f}",
                     f"{m / m_save_all:.2f}"])
    print(f"training step, 4-layer MLP body, H={H} B={B} T={T}")
    print_table(["variant", "ms", "vs loop", "peak MiB", "vs save_all"], rows)


if __name__ == "__main__":
    main()
