"""XLA SPMD: scan_layers vs the Python loop over the same sharded layers, fwd+bwd.

4 virtual CPU devices (CPU_NUM_DEVICES=4, set before torch_xla starts), SPMD
mode, Mesh(arange(4), (2, 2), ("fsdp", "tensor")). Each layer: h + b(tanh(a(h)))
with a: Linear(D, 2D), b: Linear(2D, D), weights sharded ("fsdp", "tensor"), its
output annotated ("fsdp", None) with mark_sharding_with_gradients; the input
batch is sharded ("fsdp", None). One training step: forward, sum, backward,
``torch_xla.sync()`` and wait. For each depth and variant, in a fresh process:
the first step (trace + XLA compile + run) and the steady step (best of 3).

scan_layers compiles one layer body whatever the depth; the loop unrolls every
layer into the step's graph, which XLA partitions and compiles as a whole.
Run: python benchmarks/distributed_spmd.py  (a few minutes on 2 cores)
"""
import json
import os
import subprocess
import sys
import time

DEPTHS = (8, 32, 64)
D, BATCH, STEADY_REPEAT = 64, 16, 3


def _step_times(variant, depth):
    """(first step s, steady step s) in this process (started for this one measurement)."""
    import numpy as np
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    xr.use_spmd()
    from torch_scan_hop import scan_layers

    mesh = xs.Mesh(np.arange(4), (2, 2), ("fsdp", "tensor"))
    dev = torch_xla.device()

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(D, 2 * D), torch.nn.Linear(2 * D, D)

        def forward(self, h):
            h = h + self.b(torch.tanh(self.a(h)))
            return xs.mark_sharding_with_gradients(h, mesh, ("fsdp", None))

    torch.manual_seed(0)
    layers = torch.nn.ModuleList([Block() for _ in range(depth)]).to(dev)
    for layer in layers:
        for lin in (layer.a, layer.b):
            xs.mark_sharding(lin.weight, mesh, ("fsdp", "tensor"))
    x = torch.randn(BATCH, D).to(dev)
    xs.mark_sharding(x, mesh, ("fsdp", None))
    torch_xla.sync()

    def forward(h):
        if variant == "scan_layers":
            return scan_layers(layers, h)
        for layer in layers:
            h = layer(h)
        return h

    def step():
        for p in layers.parameters():
            p.grad = None
        forward(x).sum().backward()
        torch_xla.sync()
        xm.wait_device_ops()

    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    steady = float("inf")
    for _ in range(STEADY_REPEAT):
        t0 = time.perf_counter()
        step()
        steady = min(steady, time.perf_counter() - t0)
    return first, steady


def _measure(variant, depth):
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4")
    code = f"import sys, json; sys.path.insert(0, {os.path.dirname(__file__)!r}); import distributed_spmd as b; " \
           f"print('@@', json.dumps(b._step_times({variant!r}, {depth})))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900,
                          check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@ ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{variant} depth {depth} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][3:])


def main():
    sys.path.insert(0, os.path.dirname(__file__))
    from _timing import print_table

    rows = []
    for depth in DEPTHS:
        (sf, ss), (lf, ls) = _measure("scan_layers", depth), _measure("loop", depth)
        rows.append([depth, f"{sf:.2f}", f"{lf:.2f}", f"{sf / lf:.2f}x",
                     f"{ss * 1e3:.1f}", f"{ls * 1e3:.1f}", f"{ss / ls:.2f}x"])
        print(f"depth {depth} done", file=sys.stderr, flush=True)
    print(f"XLA SPMD on 4 virtual CPU devices, mesh (2, 2) ('fsdp', 'tensor'); layer D={D}, batch {BATCH}; "
          "fwd+bwd step")
    print_table(["depth", "first scan (s)", "first loop (s)", "first ratio",
                 "steady scan (ms)", "steady loop (ms)", "steady ratio"], rows)


if __name__ == "__main__":
    main()
