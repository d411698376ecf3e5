"""torch.compile(backend="inductor"): compile time and steady runtime vs scan length.

tanh RNN cell H=64 B=8, forward, for T=16, 256, 1024: our scan, upstream torch's
scan front end (measured in a child process that never imports torch_scan_hop,
since after our import its front end would emit our op), and the unrolled
Python loop. Ours runs with its default (under torch.compile, blocks of 8
steps per loop iteration for T >= 16: inductor's while_loop pays a fixed cost
per iteration) and with unroll=1 (one body call per iteration).
Targets: compile time flat in T; steady runtime at T=1024
<= 1.5x the compiled loop.
Run: python benchmarks/compile.py [--lengths 16,256,1024]
"""
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")  # compile times, not cache hits
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _rnn import cell, run_loop  # noqa: E402
from _timing import best_time, print_table  # noqa: E402

H, B = 64, 8
UNROLL = 1



def make_fns(scan_impl, **options):
    def scanned(w, c0, xs):
        return scan_impl(cell(w), c0, xs, **options)

    return scanned, run_loop


def measure(fn, t):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(t)
    args = (torch.randn(H, H, generator=g) * 0.1, torch.zeros(B, H), torch.randn(t, B, H, generator=g))
    compiled = torch.compile(fn, backend="inductor", fullgraph=True)
    t0 = time.perf_counter()
    compiled(*args)
    first = time.perf_counter() - t0
    return first, best_time(lambda: compiled(*args), repeat=5, number=3)


def warm_up():
    """The first inductor compile in a process pays for imports and pools: not ours to count."""
    torch.compile(lambda a: torch.tanh(a) + 1, backend="inductor")(torch.ones(3))


def collect(which, lengths):
    warm_up()
    if which == "upstream":
        from torch._higher_order_ops.scan import scan as impl

        torch._dynamo.config.capture_scalar_outputs = True  # upstream needs it (pytorch 153437)
    else:
        from torch_scan_hop import scan as impl
    scanned, loop = make_fns(impl)
    results = {f"{which}|{t}": measure(scanned, t) for t in lengths}
    if which == "ours":
        results.update({f"loop|{t}": measure(loop, t) for t in lengths})
        unrolled, _ = make_fns(impl, unroll=UNROLL)
        results.update({f"ours_unroll|{t}": measure(unrolled, t) for t in lengths})
    return results


def main():
    lengths = [16, 256, 1024]
    if "--lengths" in sys.argv:
        lengths = [int(v) for v in sys.argv[sys.argv.index("--lengths") + 1].split(",")]
    if "--child" in sys.argv:
        print(json.dumps(collect("upstream", lengths)))
        return
    torch.set_num_threads(1)
    results = collect("ours", lengths)
    child = subprocess.run([sys.executable, __file__, "--child", "--lengths", ",".join(map(str, lengths))],
                           capture_output=True, text=True)
    if child.returncode:
        sys.exit(f"upstream child failed:\n{child.stderr[-3000:]}")
    results.update(json.loads(child.stdout.strip().splitlines()[-1]))
    rows = []
    for t in lengths:
        (o1, o), (k1, k), (u1, u), (l1, loop) = (results[f"{n}|{t}"] for n in (
            "ours", "ours_unroll", "upstream", "loop"))
        rows.append([t, f"{o1:.1f}", f"{o * 1e3:.2f}", f"{o / loop:.2f}x", f"{k1:.1f}", f"{k * 1e3:.2f}",
                     f"{k / loop:.2f}x", f"{u1:.1f}", f"{u * 1e3:.2f}", f"{u / loop:.2f}x", f"{l1:.1f}",
                     f"{loop * 1e3:.2f}"])
    print(f"inductor, tanh RNN H={H} B={B}, forward; compile = first call (s), run = steady per call (ms)")
    print_table(["T", "ours compile", "ours run", "ours/loop", f"ours unroll={UNROLL} compile", "run", "/loop",
                 "upstream compile", "upstream run", "upstream/loop", "loop compile", "loop run"], rows)


if __name__ == "__main__":
    main()
