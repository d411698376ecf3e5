"""Training step through scan vs a Python loop with autograd, and peak memory per remat policy.

Body: a 4-layer MLP (H=256, batch 64) applied to the carry each step, T=64 steps.
Targets: scan fwd+bwd <= 1.3x the loop; recompute_all peak memory <= 1/3 of save_all.
Run: python benchmarks/backward.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _timing import interleaved_best_times, print_table  # noqa: E402

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
    """Peak of the bytes allocated (and not yet freed) while fn runs.

    Replays the profiler's allocation record in time order, counting each op's
    SELF allocations only (an op's total includes its children's, which would
    count nested allocations twice) plus the frees reported outside any op.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live, peak = 0, 0
    for ev in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += ev.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def main():
    torch.set_num_threads(max(1, torch.get_num_threads()))
    mlp = make_model()
    c0, xs = torch.zeros(B, H), torch.randn(T, B, H)
    variants = {"python loop": lambda: loop_step(mlp, c0, xs)}
    for remat in ("save_all", "min_cut", "recompute_all"):
        variants[f"scan {remat}"] = lambda remat=remat: scan_step(mlp, c0, xs, remat)
    times = interleaved_best_times(variants, repeat=7)
    rows, base_t, base_m = [], times["python loop"], None
    for name, fn in variants.items():
        m = peak_bytes(fn)
        if name == "scan save_all":
            base_m = m
        rows.append([name, f"{times[name] * 1e3:.1f}", f"{times[name] / base_t:.2f}x", f"{m / 2**20:.1f}",
                     f"{m / base_m:.2f}" if base_m else "-"])
    print(f"training step, 4-layer MLP body, H={H} B={B} T={T}; peak = bytes allocated during the step")
    print_table(["variant", "ms", "vs loop", "peak MiB", "vs save_all"], rows)


if __name__ == "__main__":
    main()
