"""FSDP2: the for-loop vs scan_layers over ``fully_shard`` layers, eager and compiled, 2 gloo processes.

A residual MLP stack (hidden --dim, 4x expansion) 8 and 32 layers deep, every layer and the
root ``fully_shard``-ed (2 CPU processes on 127.0.0.1), batch --batch rows per rank. Per
variant: first-call time (compile included for the compiled ones), steady training step
(forward, backward, SGD step; best of --reps), and peak step memory per rank: the peak of
the bytes allocated during one steady step above its start (gathered parameters, stacked
shards, gradients, activations; the CPU allocator's events under torch.profiler). Rank 0 prints one table;
ratios are to the eager FSDP2 loop at the same depth.

Variants: loop (FSDP2's own per-layer hooks), scan (scan_layers: eager it IS the loop),
loop+compile (torch.compile of the model: Dynamo skips FSDP2's hooks, which run eagerly
between compiled layer graphs), scan+compile (one scan; each step all-gathers its layer's
shard and reduce-scatters its gradient inside the step).
Run: python benchmarks/distributed_fsdp.py [--depths 8,32] [--dim 256] [--batch 16] [--reps 5]
     [--backend inductor]
"""
import argparse
import copy
import datetime
import os
import socket
import sys
import time

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")  # each first call compiles
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
from _timing import print_table


class Layer(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, h):
        return h + self.fc2(torch.nn.functional.gelu(self.fc1(h)))


class Model(torch.nn.Module):
    def __init__(self, d, depth):
        super().__init__()
        self.layers = torch.nn.ModuleList([Layer(d) for _ in range(depth)])
        self.head = torch.nn.Linear(d, 1)
        self.scanned = False

    def forward(self, x):
        from torch_scan_hop import scan_layers

        if self.scanned:
            h = scan_layers(self.layers, x)
        else:
            h = x
            for layer in self.layers:
                h = layer(h)
        return self.head(h).square().mean()


def peak_alloc_mb(step):
    """The peak of the bytes allocated (net of frees) during ``step``, above its start: each
    op's own allocations net of frees (``self_cpu_memory_usage``, compiled code included)
    summed in the order the ops start."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    deltas = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events())
    live = peak = 0
    for _, d in deltas:
        live += d
        peak = max(peak, live)
    return peak / 2**20


def run_variant(base, name, x, reps, backend):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # FSDP2's default mesh is CUDA where a GPU is seen
    model = copy.deepcopy(base)
    model.scanned = name.startswith("scan")
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    fwd = torch.compile(model, backend=backend) if name.endswith("compile") else model
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        fwd(x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    dist.barrier()
    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    best = float("inf")
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t0)
    dist.barrier()
    peak = peak_alloc_mb(step)
    shard_mb = sum(p.to_local().numel() * p.element_size() for p in model.parameters()) / 2**20
    torch._dynamo.reset()
    return first, best, peak, shard_mb


def worker(rank, world, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    torch.compile(torch.sin, backend=args.backend)(torch.ones(2))  # compiler imports paid before timing
    variants = ["loop", "scan", "loop+compile", "scan+compile"]
    rows = []
    for depth in args.depths:
        torch.manual_seed(0)
        base = Model(args.dim, depth)
        torch.manual_seed(1 + rank)
        x = torch.randn(args.batch, args.dim)
        res = {v: run_variant(base, v, x, args.reps, args.backend) for v in variants}
        _, loop_step, loop_peak, _ = res["loop"]
        for v in variants:
            first, step, peak, shard = res[v]
            rows.append([depth, v, f"{first:.2f}", f"{step * 1e3:.1f}", f"{step / loop_step:.2f}",
                         f"{peak:.1f}", f"{peak / loop_peak:.2f}" if loop_peak > 0 else "-", f"{shard:.1f}"])
    if rank == 0:
        print(f"FSDP2, 2 gloo CPU processes, hidden {args.dim}, batch {args.batch} per rank, "
              f"backend {args.backend}, torch {torch.__version__}")
        print_table(["depth", "variant", "first call s", "step ms", "step/loop", "peak alloc MB",
                     "peak/loop", "param shard MB"], rows)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--depths", default="8,32", type=lambda s: [int(d) for d in s.split(",")])
    p.add_argument("--dim", default=256, type=int)
    p.add_argument("--batch", default=16, type=int)
    p.add_argument("--reps", default=5, type=int)
    p.add_argument("--backend", default="inductor")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(2, port, args), nprocs=2, join=True)


if __name__ == "__main__":
    main()
