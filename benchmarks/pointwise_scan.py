"""A linear recurrence h = a * h + b per channel (RG-LRU's, Mamba's state update), compiled: the scan as ONE
Triton kernel (``pointwise_scan_kernel``) against the same scan lowered to a loop (the pass off), the
compiled Python loop (small T only: Dynamo unrolls it) and, where importable, torch's own
``associative_scan`` of the same recurrence. Forward and training step, microseconds per step, and
each variant's ratio to the loop lowering measured in the same process, in interleaved rounds.

Run: python benchmarks/pointwise_scan.py [--device cuda] [--lengths 256,1024,4096] [--batch 4 --dim 1024]
On the CPU the pass does not apply (the CPU keeps its C++ loop kernel): the script then prints what it
can, as a smoke run of itself (e.g. --device cpu --lengths 16,64 --dim 64).
"""
import argparse
import os
import statistics
import sys

os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")  # each variant compiled here, under its own pass setting
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _timing import interleaved_times, print_table  # noqa: E402

from torch_scan_hop import scan  # noqa: E402
from torch_scan_hop.inductor import pointwise_scan  # noqa: E402
from torch_scan_hop.inductor.codegen import pass_counts, reset_pass_counts  # noqa: E402

LOOP_MAX_T = 256  # the compiled Python loop is unrolled by Dynamo: its compile grows with T


def _inputs(t, b, d, device, grad):
    g = torch.Generator().manual_seed(t)
    a = torch.rand(t, b, d, generator=g).mul(0.5).add(0.5).to(device).requires_grad_(grad)
    x = torch.randn(t, b, d, generator=g).to(device).requires_grad_(grad)
    h0 = torch.zeros(b, d, device=device).requires_grad_(grad)
    return h0, a, x


def _step(h, ax):
    a, x = ax
    h = a * h + x
    return h, h


def _scan_fn():
    return lambda h0, a, x: scan(_step, h0, (a, x))[1]


def _scan_fn_for_the_loop():
    """The same function with a code object of its own: Dynamo caches compiled code per code object,
    so the two variants would otherwise share one compiled graph (whichever compiled first)."""
    return lambda h0, a, x: scan(_step, h0, (a, x))[1]


def _loop_fn():
    def loop(h0, a, x):
        h, ys = h0, []
        for t in range(a.shape[0]):
            h, y = _step(h, (a[t], x[t]))
            ys.append(y)
        return torch.stack(ys)
    return loop


def _associative_fn(device):
    try:
        from torch._higher_order_ops.associative_scan import associative_scan
    except ImportError:
        return None

    def combine(left, right):
        (a1, b1), (a2, b2) = left, right
        return a1 * a2, a2 * b1 + b2

    mode = "pointwise" if device == "cuda" else "generic"

    def assoc(h0, a, x):
        # h_t = A_t * h0 + B_t with (A, B) the running composition of (a_s, x_s), s <= t
        big_a, big_b = associative_scan(combine, (a, x), dim=0, combine_mode=mode)
        return big_a * h0 + big_b
    return assoc


def _sync(device):
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def _call(fn, inputs, train, sync):
    def forward():
        with torch.no_grad():
            fn(*inputs)
        sync()

    def training():
        ys = fn(*inputs)
        torch.autograd.grad(ys.square().mean(), inputs)
        sync()
    return training if train else forward


def _prepared(name, make, inputs, train, sync):
    """The compiled variant, called once (the compile, forward and backward), each call inside its
    pass setting (a recompile keeps it); None where it cannot run."""
    fn = make()
    if fn is None:
        return None
    call = _call(torch.compile(fn), inputs, train, sync)
    on = name != "scan, loop lowering"

    def in_setting():
        with pointwise_scan.kernels_enabled(on):
            call()
    try:
        in_setting()
    except Exception as error:  # noqa: BLE001 - a variant torch cannot compile here is reported, not fatal
        print(f"  {name}: not run ({type(error).__name__}: {str(error).splitlines()[0][:100]})")
        return None
    return in_setting


def run_length(t, args, train):
    device, sync = args.device, _sync(args.device)
    inputs = _inputs(t, args.batch, args.dim, device, train)
    makers = {"scan, one kernel": _scan_fn, "scan, loop lowering": _scan_fn_for_the_loop}
    if t <= LOOP_MAX_T:
        makers["compiled Python loop"] = _loop_fn
    makers["associative_scan"] = lambda: _associative_fn(device)
    reset_pass_counts()
    torch._dynamo.reset()  # once per length: each variant keeps its compiled code while all are timed
    calls, applied = {}, 0
    for name, make in makers.items():
        call = _prepared(name, make, inputs, train, sync)
        if call is not None:
            calls[name] = call
        if name == "scan, one kernel":
            applied = pass_counts().get(pointwise_scan.PASS_NAME, {}).get("applied", 0)
    times = {name: statistics.median(ts) for name, ts in interleaved_times(calls, args.repeat).items()}
    base = times.get("scan, loop lowering")
    rows = [[name, f"{1e6 * s / t:.2f}", f"{s / base:.3f}" if base else "-"] for name, s in times.items()]
    return applied, rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--lengths", default="256,1024,4096")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(f"h = a * h + b, B={args.batch} D={args.dim} float32 on {name}, torch {torch.__version__}; "
          "us per step (median of interleaved rounds), ratio to the loop lowering in the same process")
    if args.device != "cuda" or "cuda" not in pointwise_scan.DEVICE_TYPES:
        print("(the pointwise scan kernel applies to CUDA tensors only: 'one kernel' is the loop here)")
    for train in (False, True):
        for t in (int(s) for s in args.lengths.split(",")):
            applied, rows = run_length(t, args, train)
            print(f"\n{'training step' if train else 'forward'}, T={t} (pass applied to {applied} scan node(s))")
            print_table(["variant", "us/step", "vs loop lowering"], rows)


if __name__ == "__main__":
    main()
