"""A loop that writes one row per step into a carried buffer, against the same loop returning the row.

Loops people already have preallocate their outputs (``out[t] = h``: RecurrentGemma's RG-LRU,
RWKV's wkv, a KV cache) instead of returning a row per step. Traced, our scan takes such a body
(``with_index=True`` gives ``t``): the write is an out-of-place ``index_put`` of the carried buffer.
Lowered in place it costs what a y costs (a row written per step); lowered as a copy it costs a
copy of the whole (T, H) buffer per step, O(T^2) in all. Goal (issue 63): per step within 1.2x of
the y form at T=4096. Results: docs/benchmarks.md.

Body: ``h = tanh(h @ W + x)``, H=64, one thread; rows: per-step time of the write form (``rows``:
``buf[t] = h`` into a (T, H) buffer; ``columns``: ``buf[:, t] = h`` into an (H, T) one, a row of a
later dim), of the y form, and their ratio (interleaved rounds, median of per-round ratios), for each backend: ``eager``
(the Python loop), ``aot_eager`` and ``inductor`` (torch.compile, fullgraph) and ``xla`` (lazy
tensors, PJRT_DEVICE=CPU; needs torch_xla).
Run: python benchmarks/row_writes.py [--lengths 1024,4096] [--backends eager,inductor,xla] [--forms rows,columns]
[--rounds 5]
"""
import argparse
import os
import sys

os.environ.setdefault("PJRT_DEVICE", "CPU")
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import interleaved_times, paired_ratio, print_table  # noqa: E402

from torch_scan_hop import scan  # noqa: E402

H = 64


def forms(W, T, form="rows"):
    """``(write, y)``: the loop writing row t of a carried (T, H) buffer (``columns``: column t of an
    (H, T) one, returned transposed), and returning it as a y."""
    def write_body(carry, x, t):
        h, buf = carry
        h = torch.tanh(h @ W + x)
        if form == "rows":
            buf[t] = h
        else:
            buf[:, t] = h
        return (h, buf), None

    def y_body(h, x):
        h = torch.tanh(h @ W + x)
        return h, h

    def write(h0, xs):
        shape = (T, H) if form == "rows" else (H, T)
        (_, buf), _ = scan(write_body, (h0, torch.zeros(shape, device=xs.device)), xs, with_index=True)
        return buf if form == "rows" else buf.t()

    def y(h0, xs):
        return scan(y_body, h0, xs)[1]
    return write, y


def measure(backend, T, rounds, form="rows"):
    torch.manual_seed(0)
    W, h0, xs = torch.randn(H, H) * 0.1, torch.zeros(H), torch.randn(T, H)
    sync = lambda: None  # noqa: E731
    if backend == "xla":
        import torch_xla  # noqa: PLC0415
        import torch_xla.core.xla_model as xm  # noqa: PLC0415

        dev = torch_xla.device()
        W, h0, xs = W.to(dev), h0.to(dev), xs.to(dev)

        def sync():
            torch_xla.sync()
            xm.wait_device_ops()
    write, y = forms(W, T, form)
    if backend not in ("eager", "xla"):
        torch._dynamo.reset()
        write, y = (torch.compile(f, backend=backend, fullgraph=True) for f in (write, y))
    torch.testing.assert_close(write(h0, xs).cpu(), y(h0, xs).cpu())  # also the first (compiling) calls

    def timed(f):
        def run():
            out = f(h0, xs)  # alive through the sync: lazy XLA computes only what is still referenced
            sync()
            return out
        return run
    times = interleaved_times({"write": timed(write), "y": timed(y)}, repeat=rounds)
    med, lo, hi = paired_ratio(times["write"], times["y"])
    us = {k: min(v) / T * 1e6 for k, v in times.items()}
    return [backend, form, T, f"{us['write']:.2f}", f"{us['y']:.2f}", f"{med:.2f}x [{lo:.2f}, {hi:.2f}]"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="1024,4096")
    parser.add_argument("--backends", default="eager,aot_eager,inductor,xla")
    parser.add_argument("--forms", default="rows,columns")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [measure(b, int(T), args.rounds, form) for b in args.backends.split(",") for form in args.forms.split(",")
            for T in args.lengths.split(",")]
    print_table(["backend", "form", "T", "write us/step", "y us/step", "write/y (median, 95%)"], rows)


if __name__ == "__main__":
    main()
