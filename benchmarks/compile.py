"""torch.compile(backend="inductor"): compile time and steady runtime vs scan length.

tanh RNN cell H=64 B=8, one thread, for T=16, 256, 1024, forward (or with --train a
training step: loss = c.sum() + ys.sum(), backward to W): our scan with
unroll=1 (the default) and with unroll=8 (blocks of 8 steps per loop iteration), the unrolled Python
loop, upstream torch's scan front end (measured in a child process that never
imports torch_scan_hop, since after our import its front end would emit our op), and
the floor: one compiled body step, called T times. The variants are timed round by
round in alternating order (``_timing.interleaved_times``), so a burst of load on a
shared machine hits them alike; "/loop" is the median of the rounds' ratios to the
compiled loop with its 95% bootstrap interval.
A variant's compile time is its first call in a process of its own, after the same
warm-up compile (``--first-repeats N`` such processes per variant, in alternating
order, median shown), with an inductor cache folder of its own: inductor reuses a
kernel whose binary is already in its cache folder, and keeps the kernels it built
in memory, whatever ``TORCHINDUCTOR_FORCE_DISABLE_CACHES`` says, so compiled one
after another in one process (or after an earlier run) a variant reused kernels
built before and looked cheaper. The warm-up builds what a machine builds once in that folder:
inductor's precompiled header, and for our variants our loop kernel's (``prepare_header``).
Targets: compile time flat in T and <= the compiled loop's at T=16; steady runtime
<= 1.05x the compiled loop at every T.
Run: python benchmarks/compile.py [--lengths 16,256,1024] [--train] [--rounds 30] [--first-repeats 3]
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")  # compile times, not cache hits
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _rnn import cell, run_loop
from _timing import best_time, interleaved_times, paired_ratio, print_table

H, B = 64, 8
TRAIN = "--train" in sys.argv
ROUNDS = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 30
FIRST_REPEATS = int(sys.argv[sys.argv.index("--first-repeats") + 1]) if "--first-repeats" in sys.argv else 1


def loss_of(fn):
    """``fn`` itself (forward), or a training step: loss and backward inside the compiled region."""
    if not TRAIN:
        return fn

    def step(w, c0, xs):
        c, ys = fn(w, c0, xs)
        return c.sum() + ys.sum()

    return step


def inputs(t):
    g = torch.Generator().manual_seed(t)
    w = (torch.randn(H, H, generator=g) * 0.1).requires_grad_(TRAIN)
    return w, torch.zeros(B, H), torch.randn(t, B, H, generator=g)


def compiled(fn, t):
    """``(call, first call in s)``: a zero-argument steady call of ``fn`` compiled for length ``t``."""
    torch._dynamo.reset()
    args = inputs(t)
    fn = torch.compile(loss_of(fn), backend="inductor", fullgraph=True)
    run = (lambda: fn(*args).backward()) if TRAIN else (lambda: fn(*args))
    t0 = time.perf_counter()
    run()
    return run, time.perf_counter() - t0


def body_floor(t):
    """One compiled step of the body (forward, or forward and backward), times ``t``."""
    torch._dynamo.reset()
    w, c, xs = inputs(1)
    x = xs[0]

    def step(w, c, x):
        c, y = cell(w)(c, x)
        return (c.sum() + y.sum()) if TRAIN else (c, y)

    fn = torch.compile(step, backend="inductor", fullgraph=True)
    one = (lambda: fn(w, c, x).backward()) if TRAIN else (lambda: fn(w, c, x))
    return best_time(one, repeat=20, number=20) * t


def warm_up():
    """The first inductor compile in a process pays for imports and pools: not ours to count."""
    torch.compile(lambda a: torch.tanh(a) + 1, backend="inductor")(torch.ones(3))


def collect_upstream(lengths):
    from torch._higher_order_ops.scan import scan

    torch._dynamo.config.capture_scalar_outputs = True  # upstream needs it (pytorch 153437)
    warm_up()
    out = {}
    for t in lengths:
        run, first = compiled(lambda w, c0, xs: scan(cell(w), c0, xs), t)
        out[t] = (first, best_time(run, repeat=5, number=3))
    return out


PHASES = {"Dynamo (bytecode tracing)": "bytecode_tracing", "AOT joint trace": "aot_trace_joint_graph",
          "partition": "min_cut_rematerialization_partition", "inductor lowering": "GraphLowering.run",
          "inductor codegen": "GraphLowering.codegen", "waiting for C++ kernels": "async_compile.wait"}


def print_breakdown():
    """Where a first call's time went (forward and backward compiles summed), from Dynamo's
    own phase timers (``--first VARIANT --breakdown``)."""
    from torch._dynamo.utils import compilation_time_metrics

    for label, key in PHASES.items():
        print(f"{label:28s} {sum(compilation_time_metrics.get(key, [])):7.2f} s")


def variants():
    from torch_scan_hop import scan

    return {"unroll1": lambda w, c0, xs: scan(cell(w), c0, xs, unroll=1),
            "unroll8": lambda w, c0, xs: scan(cell(w), c0, xs, unroll=8),
            "loop": run_loop}


def collect_ours(t):
    """Every round's time per call of ours (unroll=1 and 8) and the loop."""
    runs = {name: compiled(fn, t)[0] for name, fn in variants().items()}
    return interleaved_times(runs, repeat=ROUNDS)


def first_calls(t):
    """Median first call (s) of each variant, each in a fresh process after the warm-up."""
    names, out = list(variants()), {}
    for r in range(FIRST_REPEATS):
        for name in (names if r % 2 == 0 else names[::-1]):
            cmd = [sys.executable, __file__, "--first", name, "--lengths", str(t), *(["--train"] if TRAIN else [])]
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
                child = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
            out.setdefault(name, []).append(float(child.stdout.strip().splitlines()[-1]))
    return {name: statistics.median(v) for name, v in out.items()}


def ratio_cell(times, name):
    med, lo, hi = paired_ratio(times[name], times["loop"])
    return f"{med:.2f}x [{lo:.2f},{hi:.2f}]"


def main():
    lengths = [16, 256, 1024]
    if "--lengths" in sys.argv:
        lengths = [int(v) for v in sys.argv[sys.argv.index("--lengths") + 1].split(",")]
    torch.set_num_threads(1)
    if "--child" in sys.argv:
        print(json.dumps(collect_upstream(lengths)))
        return
    if "--first" in sys.argv:
        warm_up()
        if sys.argv[sys.argv.index("--first") + 1] != "loop":  # our loop kernel's header, as inductor's above
            from torch_scan_hop.inductor.codegen.kernel_build import prepare_header

            prepare_header()
        torch._dynamo.utils.reset_frame_count()
        first = compiled(variants()[sys.argv[sys.argv.index("--first") + 1]], lengths[0])[1]
        if "--breakdown" in sys.argv:
            print_breakdown()
        print(first)
        return
    warm_up()
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        child = subprocess.run([sys.executable, __file__, "--child", "--lengths", ",".join(map(str, lengths)),
                                *(["--train"] if TRAIN else [])], check=False, capture_output=True, text=True,
                               env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache})
    upstream = json.loads(child.stdout.strip().splitlines()[-1]) if child.returncode == 0 else {}
    for t in lengths:
        first, times = first_calls(t), collect_ours(t)
        best = {k: min(v) for k, v in times.items()}
        up = upstream.get(str(t))
        rows.append([t, f"{first['unroll1']:.1f}", f"{best['unroll1'] * 1e3:.3f}", ratio_cell(times, "unroll1"),
                     f"{first['unroll8']:.1f}", f"{best['unroll8'] * 1e3:.3f}", ratio_cell(times, "unroll8"),
                     f"{first['loop']:.1f}", f"{best['loop'] * 1e3:.3f}", f"{body_floor(t) * 1e3:.3f}",
                     f"{up[0]:.1f}" if up else "-", f"{up[1] / best['loop']:.2f}x" if up else "-"])
    if child.returncode:
        print(f"upstream child failed:\n{child.stderr[-2000:]}")
    what = "training step (fwd+bwd)" if TRAIN else "forward"
    print(f"inductor, tanh RNN H={H} B={B}, {what}, one thread; compile = first call (s), run = best steady call"
          f" (ms), /loop = median of {ROUNDS} interleaved rounds' ratios [95% interval]; compile = median first call"
          f" of {FIRST_REPEATS} fresh process(es) each")
    print_table(["T", "unroll=1 compile", "run", "/loop", "unroll=8 compile", "run", "/loop",
                 "loop compile", "loop run", "body x T", "upstream compile", "upstream/loop"], rows)


if __name__ == "__main__":
    main()
