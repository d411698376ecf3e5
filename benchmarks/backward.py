"""Training step through scan vs a Python loop with autograd: time and peak memory per remat policy.

Body: a 4-layer MLP (H=256, batch 64) applied to the carry each step, T=64 steps, one thread.
Rows: the loop, the loop plus one more forward (the floor of any policy that recomputes a step),
the loop with a torch.utils.checkpoint per step, and scan with every policy. Times are CPU time
of the process (best of interleaved rounds): on a shared box wall time mostly measures the neighbours.
Targets: recompute_all <= 1.4x the loop, peak <= 1/3 of save_all; min_cut <= 1.5x, peak <= 0.6.

``--sweep`` adds the length sweep: a small RNN (H=32, batch 8), T = 256 .. 16384, peak memory and time
per policy, eager and compiled (``--no-traced``: eager only; ``--lengths`` to choose; ``--plot`` draws
benchmarks/remat.png, peak and time vs T, log axes).
``--compiled`` adds inductor's peak per policy against eager's (issue 39 item 6 on the CPU).
Run: python benchmarks/backward.py [--sweep [--plot] [--no-eager|--no-traced] [--rounds N] [--backend B]]
     [--lengths 256,1024,4096] [--compiled] [--skip-mlp]
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _timing import interleaved_times, print_table  # noqa: E402

from torch_scan_hop import RematPolicy, checkpoint_name, dots_saveable, save_only_these_names, scan  # noqa: E402

H, B, T, LAYERS = 256, 64, 64, 4


def make_model():
    torch.manual_seed(0)
    return torch.nn.ModuleList(torch.nn.Linear(H, H) for _ in range(LAYERS))


def body_for(mlp):
    def body(c, x):
        h = c + x
        for k, lin in enumerate(mlp):
            h = checkpoint_name(torch.tanh(lin(h)), f"layer{k}")
        return h, h.mean(-1)
    return body


def loop_step(mlp, c, xs, step=None):
    body = body_for(mlp)
    step = step or body
    ys = []
    for x in xs:
        c, y = step(c, x)
        ys.append(y)
    (c.sum() + torch.stack(ys).sum()).backward()


def forward_only(mlp, c, xs):
    body = body_for(mlp)
    for x in xs:
        c, _ = body(c, x)


def scan_step(mlp, c, xs, remat):
    c, ys = scan(body_for(mlp), c, xs, remat=remat)
    (c.sum() + ys.sum()).backward()


def peak_bytes(fn):
    """Peak of the bytes allocated (and not yet freed) while fn runs.

    Replays the profiler's allocation record in time order, counting each op's
    SELF allocations only (an op's total includes its children's, which would
    count nested allocations twice) plus the frees reported outside any op.
    Collected first: garbage of an earlier run freed in the window would lower it.
    """
    import gc

    from torch.profiler import ProfilerActivity, profile

    gc.collect()  # garbage of an earlier run freed inside the window would count as negative
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live, peak = 0, 0
    for ev in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += ev.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


POLICIES = {
    "save_all": "save_all",
    "recompute_all": "recompute_all",
    "sqrt": "sqrt",
    "binomial(8)": ("binomial", 8),
    "min_cut": "min_cut",
    "dots_saveable": dots_saveable,
    "names(layer1, layer3)": save_only_these_names("layer1", "layer3"),
    "user op policy (addmm)": RematPolicy(lambda op, name: op is torch.ops.aten.addmm.default, label="addmm"),
}


def mlp_table(repeat):
    from torch.utils.checkpoint import checkpoint

    mlp = make_model()
    c0, xs = torch.zeros(B, H), torch.randn(T, B, H)
    variants = {
        "python loop": lambda: loop_step(mlp, c0, xs),
        "loop + one more forward": lambda: (loop_step(mlp, c0, xs), forward_only(mlp, c0, xs)),
        "loop + checkpoint per step": lambda: loop_step(
            mlp, c0, xs, lambda c, x: checkpoint(body_for(mlp), c, x, use_reentrant=False)),
    }
    for name, remat in POLICIES.items():
        variants[f"scan {name}"] = lambda remat=remat: scan_step(mlp, c0, xs, remat)
    times = {k: min(v) for k, v in interleaved_times(variants, repeat=repeat, clock=time.process_time).items()}
    base_t, base_m = times["python loop"], peak_bytes(lambda: scan_step(mlp, c0, xs, "save_all"))
    rows = []
    for name, fn in variants.items():
        m = peak_bytes(fn) if name.startswith("scan") or name == "python loop" else None
        rows.append([name, f"{times[name] * 1e3:.1f}", f"{times[name] / base_t:.2f}x",
                     "-" if m is None else f"{m / 2**20:.1f}", "-" if m is None else f"{m / base_m:.2f}"])
    print(f"training step, 4-layer MLP body, H={H} B={B} T={T}, 1 thread; ms = best CPU time; "
          "peak = bytes allocated during the step")
    print_table(["variant", "ms", "vs loop", "peak MiB", "vs save_all"], rows)


def trace_peak(fn):
    """Peak bytes allocated while fn runs, from the profiler's raw allocation record ("Total
    Allocated" of its [memory] events): unlike ``peak_bytes`` it sees allocations inside a compiled
    graph's call (an op's self memory is only their net). The compiled loop's buffer pool is emptied
    first, so the storage it hands out is allocated inside the window."""
    import gc
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    import torch_scan_hop

    torch_scan_hop.empty_cache()
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace:
            events = [e["args"] for e in json.load(trace)["traceEvents"] if e.get("name") == "[memory]"]
    start = events[0]["Total Allocated"] - events[0]["Bytes"]
    return max(e["Total Allocated"] for e in events) - start


def compiled_peaks():
    """Issue 39 item 6 on the CPU: inductor's peak per policy against eager's, same body."""
    from torch.utils.checkpoint import checkpoint

    mlp = make_model()
    c0, xs = torch.zeros(B, H), torch.randn(T, B, H)
    base = trace_peak(lambda: loop_step(mlp, c0, xs))
    ckpt = trace_peak(lambda: loop_step(mlp, c0, xs, lambda c, x: checkpoint(body_for(mlp), c, x,
                                                                              use_reentrant=False)))
    rows = [["python loop", "1.00", "-"], ["loop + checkpoint per step", f"{ckpt / base:.2f}", "-"]]
    for name in ("save_all", "recompute_all", "min_cut"):
        def step(name=name):
            scan_step(mlp, c0, xs, name)
        compiled = torch.compile(step)
        compiled()
        rows.append([f"scan {name}", f"{trace_peak(step) / base:.2f}", f"{trace_peak(compiled) / base:.2f}"])
    print(f"\npeak vs the loop's ({base / 2**20:.1f} MiB), eager and inductor (profiler allocation record)")
    print_table(["variant", "eager", "inductor"], rows)


SWEEP_POLICIES = [("save_all", "save_all"), ("recompute_all", "recompute_all"), ("sqrt", "sqrt"),
                  ("binomial(16)", ("binomial", 16))]
TRACED_POLICIES = ("save_all", "recompute_all", "sqrt")  # traced binomial is recompute_all


def rnn_sweep(lengths, hidden=32, batch=8, traced=True, eager=True, rounds=None, backend="aot_eager"):
    """Peak and CPU time per policy and length; eager rows and, with ``traced``, the same step compiled
    (``torch.compile(backend=backend)``; "aot_eager": AOTAutograd's partitioned scans, each step a graph call).
    Peaks are ``trace_peak``'s (the profiler's raw allocation record, which also sees allocations in a
    compiled graph's call). ``rounds``: interleaved rounds per length (default 3 up to T=1024, then 1:
    the eager rows' Python dominates there, and a round of T=16384 takes seconds)."""
    torch.manual_seed(0)
    w = (torch.randn(hidden, hidden) / hidden ** 0.5).requires_grad_()

    def body(c, x):
        c = torch.tanh(c @ w + x)
        return c, c.sum(-1)

    def step(remat, c0, xs):
        c, ys = scan(body, c0, xs, remat=remat)
        (c.sum() + ys.sum()).backward()

    rows = []
    print(f"\nlength sweep, RNN c = tanh(c @ W + x), H={hidden} batch {batch}, 1 thread", flush=True)
    for length in lengths:
        torch._dynamo.reset()  # one graph per policy and length: stay under Dynamo's recompile limit
        compiled = torch.compile(step, backend=backend, dynamic=False)
        c0, xs = torch.zeros(batch, hidden), torch.randn(length, batch, hidden)
        variants = {name: (lambda r=r: step(r, c0, xs)) for name, r in SWEEP_POLICIES} if eager else {}
        if traced:
            variants.update({f"{name} ({backend})": (lambda r=name: compiled(r, c0, xs)) for name in TRACED_POLICIES})
        repeat = rounds or (3 if length <= 1024 else 1)
        times = {k: min(v) for k, v in interleaved_times(variants, repeat=repeat, clock=time.process_time).items()}
        peaks = {k: trace_peak(fn) for k, fn in variants.items()}
        for k in variants:
            suffix = f" ({backend})" if k.endswith(f"({backend})") else ""
            base, ref = "save_all" + suffix, "recompute_all" + suffix
            rows.append([length, k, f"{times[k] * 1e3:.0f}", f"{times[k] / times[base]:.2f}x",
                         f"{peaks[k] / 2**20:.2f}", f"{peaks[k] / peaks[base]:.3f}", f"{peaks[k] / peaks[ref]:.3f}"])
            print(*rows[-1], flush=True)  # long runs: each row as it comes
    print_table(["T", "policy", "ms", "vs save_all", "peak MiB", "peak/save_all", "peak/recompute_all"], rows)
    return rows


def plot(rows, path):
    """Peak memory and time against T per policy (log axes), from ``rnn_sweep``'s rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, ms) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in dict.fromkeys(r[1] for r in rows):
        pts = [(r[0], float(r[4]), float(r[2])) for r in rows if r[1] == name]
        style = "--" if "(" in name and "binomial" not in name else "-"
        mem.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=name)
        ms.plot([p[0] for p in pts], [p[2] for p in pts], style, marker="o", label=name)
    for ax, label in ((mem, "peak MiB"), (ms, "training step, ms (CPU time)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("T (steps)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    mem.legend(fontsize=7)
    fig.suptitle("remat policies, RNN H=32 batch 8 (eager solid, torch.compile aot_eager dashed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--lengths", default="256,1024,4096,8192,16384")
    parser.add_argument("--no-traced", action="store_true", help="sweep: eager rows only")
    parser.add_argument("--no-eager", action="store_true", help="sweep: compiled rows only")
    parser.add_argument("--rounds", type=int, help="sweep: interleaved rounds per length (default 3, 1 above 1024)")
    parser.add_argument("--backend", default="aot_eager", help="sweep: torch.compile backend of the compiled rows")
    parser.add_argument("--plot", action="store_true", help="sweep: draw benchmarks/remat.png")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--skip-mlp", action="store_true")
    parser.add_argument("--compiled", action="store_true", help="inductor peaks per policy (issue 39 item 6)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not args.skip_mlp:
        mlp_table(args.repeat)
    if args.compiled:
        compiled_peaks()
    if args.sweep:
        rows = rnn_sweep([int(n) for n in args.lengths.split(",")], traced=not args.no_traced,
                         eager=not args.no_eager, rounds=args.rounds, backend=args.backend)
        if args.plot:
            plot(rows, os.path.join(os.path.dirname(os.path.abspath(__file__)), "remat.png"))


if __name__ == "__main__":
    main()
