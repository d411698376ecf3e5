"""scan_layers vs torch_xla's scan_layers vs the for-loop: a decoder stack 8, 32 and 64 deep.

Pre-norm decoder block (hidden 128, 4 heads, causal attention), batch 4, sequence 16 (--batch), training
step (forward + backward). On XLA (CPU): first call (trace + compile + run) and steady step
time. Under inductor (CPU): compile (first call) and steady step time. One table each and a
PNG plot of the XLA first-call times.
"stacked" is ours on layers given stacked storage by ``stack_layers`` (no stack of the weights per
call, one stacked gradient handed back as row views); "stacked_g" the same with
``stack_layers(grads="stacked")`` (the stacks are the trained parameters: one gradient per name, no
per-layer ``.grad``).
Targets: compile time flat in depth and <= torch_xla's scan_layers; steady step <= 1.2x the loop
(stacked: <= 1.0x under inductor, first compile at depth 64 <= 1.2x depth 8). Under inductor the
steps are interleaved round by round: "/loop" is best over best, "median/loop" the median of the
rounds' ratios with a 95% bootstrap interval (an interval containing 1.0 is a tie on this machine).
Run: python benchmarks/layers.py [--depths 8,32,64] [--batch 4x16] [--plot benchmarks/layers.png]
     [--skip-inductor|--skip-xla] [--reps 30]
"""
import copy
import os
import sys
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "support"))
sys.path.insert(0, os.path.dirname(__file__))
from _timing import interleaved_times, paired_ratio, print_table  # noqa: E402
from decoder import make_stack, run_loop  # noqa: E402

from torch_scan_hop import scan_layers, stack_layers  # noqa: E402

D, HEADS, BATCH, SEQ = 128, 4, 4, 16


def ours(layers, x):
    return scan_layers(layers, x)


def torch_xla_scan_layers(layers, x):
    from torch_xla.experimental.scan_layers import scan_layers as txla

    return txla(layers, x)


def step(fn, layers, x, sync):
    layers.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    fn(layers, x).pow(2).mean().backward()
    sync([p.grad for p in layers.parameters() if p.grad is not None])
    return time.perf_counter() - t0


def prepare(name, base):
    """A fresh copy of the stack for one variant (stacked storage for "stacked")."""
    layers = copy.deepcopy(base)
    if name == "stacked_g":
        return stack_layers(layers, grads="stacked")
    return stack_layers(layers) if name == "stacked" else layers


def measure(fn, layers, x, sync, reps=3):
    first = step(fn, layers, x, sync)
    return first, min(step(fn, layers, x, sync) for _ in range(reps))


def xla_table(depths):
    import torch_xla

    dev = torch_xla.device()

    def sync(tensors):
        torch_xla.sync()
        torch_xla._XLAC._xla_wait_device_ops([])  # noqa: SLF001
        tensors[0].cpu()

    (torch.ones(4, device=dev) * 2).cpu()  # one-time PJRT client start-up is not charged to the first row
    # nor Dynamo's start-up (an eager scan on XLA runs through it): a scan of another body
    from torch_scan_hop import scan

    scan(lambda c, x: (c + x, c), torch.zeros(2, device=dev), torch.ones(3, 2, device=dev))[0].cpu()
    results = {}
    for depth in depths:
        base = make_stack(depth, D, HEADS)
        x = torch.randn(BATCH, SEQ, D).to(dev)
        for name, fn in (("ours", ours), ("stacked", ours), ("stacked_g", ours), ("torch_xla", torch_xla_scan_layers),
                         ("loop", run_loop)):
            results[name, depth] = measure(fn, prepare(name, base).to(dev), x, sync)
    return results


def inductor_table(depths, reps=30):
    """First call per variant (Dynamo caches reset per depth), then the steady steps of both
    variants interleaved: a VM's bursts of load hit ours and the loop alike."""
    # one-time inductor start-up (C++ toolchain checks, headers) is not charged to the first row
    torch.compile(lambda t: (t * 2).sum(), backend="inductor")(torch.ones(4, requires_grad=True)).backward()
    results = {}
    for depth in depths:
        base = make_stack(depth, D, HEADS)
        x = torch.randn(BATCH, SEQ, D)
        torch._dynamo.reset()
        steps = {}
        for name, fn in (("ours", ours), ("stacked", ours), ("stacked_g", ours), ("loop", run_loop)):
            compiled, layers = torch.compile(fn, backend="inductor"), prepare(name, base)
            steps[name] = lambda c=compiled, l=layers: step(c, l, x, lambda ts: None)
            results[name, depth] = steps[name]()
        times = interleaved_times(steps, reps)
        for name, ts in times.items():
            results[name, depth] = (results[name, depth], min(ts))
        for name in ("ours", "stacked", "stacked_g"):
            results["paired", name, depth] = paired_ratio(times[name], times["loop"])
    return results


def report(title, results, depths, names):
    """Per variant: first call, best step, best / loop's best and, where the steps were
    interleaved (inductor), the median of per-round ratios with its 95% interval."""
    paired = [n for n in names if ("paired", n, depths[0]) in results]
    rows = []
    for d in depths:
        loop_first, loop_run = results["loop", d]
        row = [d]
        for n in names:
            first, run = results[n, d]
            row += [f"{first:.2f}", f"{run * 1e3:.1f}", f"{run / loop_run:.2f}x"]
        for n in paired:
            med, lo, hi = results["paired", n, d]
            row.append(f"{med:.3f}x [{lo:.3f}, {hi:.3f}]")
        rows.append(row)
    print(title)
    print_table(["depth"] + [f"{n} {c}" for n in names for c in ("1st s", "step ms", "/loop")]
                + [f"{n} median/loop [95%]" for n in paired], rows)


def plot(results, depths, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ("ours", "stacked", "stacked_g", "torch_xla", "loop"):
        ax.plot(depths, [results[name, d][0] for d in depths], marker="o", label=name)
    ax.set(xlabel="depth (layers)", ylabel="first training step: trace + compile + run (s)",
           title=f"decoder stack on XLA (CPU), hidden {D}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot written to {path}")


def main():
    global BATCH, SEQ
    depths = [8, 32, 64]
    if "--batch" in sys.argv:  # BxS, e.g. 8x128: more tokens per weight than the default 4x16
        BATCH, SEQ = (int(v) for v in sys.argv[sys.argv.index("--batch") + 1].split("x"))
    if "--depths" in sys.argv:
        depths = [int(v) for v in sys.argv[sys.argv.index("--depths") + 1].split(",")]
    if "--skip-xla" not in sys.argv:
        xla = xla_table(depths)
        report(f"XLA (CPU) training step, decoder hidden {D}, batch {BATCH}x{SEQ}", xla, depths,
               ["ours", "stacked", "stacked_g", "torch_xla", "loop"])
        if "--plot" in sys.argv:
            plot(xla, depths, sys.argv[sys.argv.index("--plot") + 1])
    if "--skip-inductor" not in sys.argv:
        torch.set_num_threads(1)
        reps = int(sys.argv[sys.argv.index("--reps") + 1]) if "--reps" in sys.argv else 30
        report(f"inductor (CPU) training step, batch {BATCH}x{SEQ}", inductor_table(depths, reps), depths,
               ["ours", "stacked", "stacked_g", "loop"])


if __name__ == "__main__":
    main()
