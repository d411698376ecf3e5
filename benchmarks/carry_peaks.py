"""Compiled peaks against eager's per remat policy, with and without ``carry_in_place`` (issue 64 item 5).

Body: the 4-layer MLP of ``tests/remat`` (``tanh(Linear(h))``, width W), batch B, T steps; a training
step (forward and backward). The compiled loop's backward carries each weight gradient; before
``inductor.codegen.carry_in_place`` every step's new sum had a new buffer while the old one and the
loop's zeros stayed alive. Rows per policy: eager's peak, inductor's with the pass off and on (same
process, caches off so each compile runs the pipeline), and the step's time with the pass off and on
(best CPU time of interleaved rounds, one thread: on a shared box wall time measures the neighbours).
Peaks: the profiler's allocation record (``backward.trace_peak``).

Run: python benchmarks/carry_peaks.py [--width 1024] [--batch 8] [--length 8] [--rounds 7]
     [--policies save_all,recompute_all,min_cut,sqrt]
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _timing import interleaved_times, print_table  # noqa: E402
from backward import trace_peak  # noqa: E402

from torch_scan_hop import checkpoint_name, scan  # noqa: E402
from torch_scan_hop.inductor.codegen import pass_counts, passes_off, reset_pass_counts  # noqa: E402

PASS = "accumulate_carries_in_place"


def mlp_body(width, depth=4):
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def body(c, x):
        h = c + x
        for k, lin in enumerate(layers):
            h = checkpoint_name(torch.tanh(lin(h)), f"layer{k}")
        return h, h.mean(-1)

    return body, layers


def compiled_step(loss, layers, off):
    """A training step of ``loss`` compiled now (its forward and, lazily, its backward: so that
    ``passes_off`` applies to both), without caches."""
    def step():
        loss().backward()
        layers.zero_grad(set_to_none=True)

    with torch._inductor.config.patch(force_disable_caches=True):
        if off:
            with passes_off(PASS):
                step()
        else:
            step()
    return step


def row(remat, body, layers, c0, xs, rounds):
    # two functions of one text: Dynamo compiles per code object, so each gets its own graphs (a
    # function called by both would be compiled once, a reset between would recompile the first)
    def loss_off():
        c, ys = scan(body, c0, xs, remat=remat)
        return c.sum() + ys.sum()

    def loss_on():
        c, ys = scan(body, c0, xs, remat=remat)
        return c.sum() + ys.sum()

    def eager():
        loss_off().backward()
        layers.zero_grad(set_to_none=True)

    torch._dynamo.reset()
    before = compiled_step(torch.compile(loss_off), layers, off=True)
    reset_pass_counts()
    after = compiled_step(torch.compile(loss_on), layers, off=False)
    applied = pass_counts().get(PASS, {}).get("applied", 0)
    peaks = [trace_peak(f) / 2 ** 20 for f in (eager, before, after)]
    times = interleaved_times({"off": before, "on": after}, repeat=rounds, clock=time.process_time)
    off, on = min(times["off"]) * 1e3, min(times["on"]) * 1e3
    return [remat, f"{peaks[0]:.1f}", f"{peaks[1]:.1f}", f"{peaks[2]:.1f}", f"{off:.2f}", f"{on:.2f}",
            f"{on / off:.2f}", applied]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--policies", default="save_all,recompute_all,min_cut,sqrt")
    args = parser.parse_args()
    torch.set_num_threads(1)
    body, layers = mlp_body(args.width)
    c0, xs = torch.zeros(args.batch, args.width), torch.randn(args.length, args.batch, args.width)
    rows = [row(remat, body, layers, c0, xs, args.rounds) for remat in args.policies.split(",")]
    print(f"training step, 4-layer MLP body, W={args.width} B={args.batch} T={args.length}, 1 thread, "
          f"torch {torch.__version__}; peaks in MiB (profiler allocation record), ms = best CPU time of "
          f"{args.rounds} interleaved rounds; 'in place' = loops the pass rewrote (compile with it on)")
    print_table(["policy", "eager peak", "compiled, pass off", "compiled, pass on", "ms off", "ms on",
                 "on / off", "in place"], rows)


if __name__ == "__main__":
    main()
