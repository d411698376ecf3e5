"""Compile time on XLA (CPU) vs scan length: our While vs torch_xla's scan vs unrolled baselines.

Body (benchmarks/_rnn.py): c = tanh(c @ W + x); y = c.sum(-1), H=64, batch 8. For each N:
first call (trace + compile + run), our second call at that shape (Dynamo's
capture) and steady per-call time, forward-only and training (backward to W).
torch_xla's scan gets W in the carry (it cannot read closures). Upstream
torch's scan and a Python loop unroll, so they run up to N=100 only; upstream's
rows run in a subprocess WITHOUT torch_scan_hop imported (after our import,
upstream's front end would run on our op); --skip-unrolled leaves them out
(they take most of the run on a busy box and involve nothing of ours).
Targets: ours flat in N (N=1000 <= 1.2x N=10) and <= torch_xla's scan on every row.
Run: python benchmarks/xla_compile.py [--plot out.png] [--skip-unrolled]
"""
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")
import torch  # noqa: E402
import torch_xla  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _rnn import cell, run_loop  # noqa: E402
from _timing import print_table  # noqa: E402

H, B = 64, 8
LENGTHS = (10, 100, 1000)
UNROLLED_MAX = 100
DEV = torch_xla.device()


def make_inputs(n, batch=B):
    g = torch.Generator().manual_seed(n)
    w = (torch.randn(H, H, generator=g) * 0.1).to(DEV)
    return w, torch.zeros(batch, H).to(DEV), torch.randn(n, batch, H, generator=g).to(DEV)



def run_ours(w, c0, xs):
    from torch_scan_hop import scan

    return scan(cell(w), c0, xs)


def run_torch_xla(w, c0, xs):
    from torch_xla.experimental.scan import scan

    def body(carry, x):
        c, w_ = carry
        c = torch.tanh(c @ w_ + x)
        return (c, w_), c.sum(-1)

    (c, _), ys = scan(body, (c0, w), xs)
    return c, ys


def run_upstream(w, c0, xs):
    from torch._higher_order_ops.scan import scan

    return scan(lambda c, x: cell(w)(c, x), c0, xs)


def one_call(runner, inputs, train):
    w, c0, xs = inputs
    w.grad = None
    t0 = time.perf_counter()
    c, ys = runner(w, c0, xs)
    if train:
        (c.sum() + ys.sum()).backward()
        outs = [w.grad]
    else:
        outs = [c, ys]
    torch_xla.sync()
    for o in outs:
        o.cpu()
    return time.perf_counter() - t0


FIRST_SAMPLES = 5


def first_call_batches(train):
    """Batch sizes of the first-call samples: each a fresh trace and compile. Training uses
    other sizes than the forward rows: at a shape the forward rows compiled, a training
    call finds part of its work (its forward computation) in XLA's compilation cache, and
    would not be a first call."""
    start = B + 1 + (FIRST_SAMPLES if train else 0)
    return range(start, start + FIRST_SAMPLES)


def steady(runner, n, train, reps=3):
    """(second call, best steady call) at the benchmark's shape; the same W is reused, as in
    a training loop. The second call at a shape is where ours is captured by Dynamo (the
    first is traced with make_fx), so it is reported too."""
    inputs = make_inputs(n)
    inputs[0].requires_grad_(train)
    one_call(runner, inputs, train)
    second = one_call(runner, inputs, train)
    return second, min(one_call(runner, inputs, train) for _ in range(reps))


def measure_all(names, n, train):
    """``{name: (first call, second call, best steady call)}``. A first call happens once
    per shape, so it is sampled on ``FIRST_SAMPLES`` batch sizes, the runners taking turns
    (order alternating) so that a burst of load on a shared box hits them alike, and the
    best sample is kept."""
    firsts = {name: [] for name in names}
    for k, batch in enumerate(first_call_batches(train)):
        for name in (names if k % 2 == 0 else names[::-1]):
            fresh = make_inputs(n, batch)
            fresh[0].requires_grad_(train)
            firsts[name].append(one_call(RUNNERS[name], fresh, train))
    return {name: (min(firsts[name]), *steady(RUNNERS[name], n, train)) for name in names}


RUNNERS = {"ours": run_ours, "torch_xla scan": run_torch_xla, "upstream scan": run_upstream,
           "python loop": run_loop}


def collect(names):
    results = {}
    for train in (False, True):
        for n in LENGTHS:
            here = [name for name in names if name not in ("upstream scan", "python loop") or n <= UNROLLED_MAX]
            for name, r in measure_all(here, n, train).items():
                results[f"{name}|{n}|{int(train)}"] = r
    return results


def upstream_in_subprocess():
    """Upstream's scan and the loop, measured in a process that never imports torch_scan_hop."""
    out = subprocess.run([sys.executable, __file__, "--child"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    if "--child" in sys.argv:
        print(json.dumps(collect(["upstream scan", "python loop"])))
        return
    import torch_scan_hop  # noqa: F401  (installs our op; upstream rows ran in the child)

    results = collect(["ours", "torch_xla scan"])
    if "--skip-unrolled" not in sys.argv:
        results.update(upstream_in_subprocess())
    rows = []
    for train in (False, True):
        for n in LENGTHS:
            ours_first, ours_second, ours_steady = results[f"ours|{n}|{int(train)}"]
            txla_first, _, txla_steady = results[f"torch_xla scan|{n}|{int(train)}"]
            row = ["train" if train else "fwd", n, f"{ours_first:.2f}", f"{ours_second:.2f}", f"{ours_steady * 1e3:.1f}",
                   f"{txla_first:.2f}", f"{txla_steady * 1e3:.1f}", f"{ours_first / txla_first:.2f}x"]
            for name in ("upstream scan", "python loop"):
                r = results.get(f"{name}|{n}|{int(train)}")
                row.append(f"{r[0]:.2f}" if r else "-")
            rows.append(row)
    print(f"XLA on {os.environ['PJRT_DEVICE']}: tanh RNN H={H} B={B}; first call = trace+compile+run (s), "
          "steady = per call (ms)")
    print_table(["mode", "N", "ours 1st s", "ours 2nd s", "ours ms", "txla 1st s", "txla ms", "ours/txla 1st",
                 "upstream 1st s", "loop 1st s"], rows)
    for train in (False, True):
        first = [results[f"ours|{n}|{int(train)}"][0] for n in LENGTHS]
        print(f"{'train' if train else 'fwd'}: ours first call N={LENGTHS[-1]} / N={LENGTHS[0]} = "
              f"{first[-1] / first[0]:.2f}x")
    if "--plot" in sys.argv:
        plot(results, sys.argv[sys.argv.index("--plot") + 1])


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, train in zip(axes, (False, True)):
        for name in RUNNERS:
            pts = [(n, results[k][0]) for n in LENGTHS if (k := f"{name}|{n}|{int(train)}") in results]
            ax.plot(*zip(*pts), marker="o", label=name)
        ax.set(xscale="log", yscale="log", xlabel="scan length N", title="training" if train else "forward")
    axes[0].set_ylabel("first call: trace + compile + run (s)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot written to {path}")


if __name__ == "__main__":
    main()
