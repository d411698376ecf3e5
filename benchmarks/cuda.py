"""CUDA: our scan against the Python loop on the same GPU, measured in the same process.

Three parts, each in a child process of its own (a crash or hang in one leaves the others):
  first  - first call (trace + compile + run) under inductor of ours (default unroll, unroll=1)
           and of the compiled loop, tanh RNN H=256 B=32, T=16 and 256, forward and training,
           every variant in a fresh process with an inductor cache of its own after the same
           warm-up compile; with where ours spent it (Dynamo's phase timers) and how many
           Triton and C++ kernels its output code defines.
  steady - steady calls (best of interleaved rounds, CUDA-synchronized): inductor forward, ours
           (default and unroll=1, also under mode="reduce-overhead") vs the compiled loop; eager
           training step and eager no-grad forward, ours vs the loop.
  steps  - per-step cost under the profiler (tanh RNN, T from --lengths): wall us/step against the
           body's kernel time per step, kernel launches and CUDA graph launches per call, and the
           host syncs per call (stream/device/event synchronize, device-to-host copies): a step
           should cost its launches and nothing more, and nothing should wait on the GPU per step.
  peaks  - peak memory (torch.cuda.max_memory_allocated over one training step, after a warm-up
           step) and time per remat policy, eager and compiled, MLP body d=1024 B=64 T=128,
           against the loop and the loop with torch.utils.checkpoint per step.
Run: python benchmarks/cuda.py [--parts first,steady,peaks] [--lengths 16,256]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _rnn import cell, run_loop  # noqa: E402
from _timing import interleaved_times, print_table  # noqa: E402

H, B = 256, 32
DEV = os.environ.get("SCAN_BENCH_DEVICE", "cuda")  # "cpu": a smoke run of the script itself


def _device_name():
    return torch.cuda.get_device_name() if DEV == "cuda" else DEV


def _sync_call(fn):
    def call():
        fn()
        if DEV == "cuda":
            torch.cuda.synchronize()
    return call


def _rnn_inputs(t, grad):
    g = torch.Generator().manual_seed(t)
    w = (torch.randn(H, H, generator=g) * 0.05).to(DEV).requires_grad_(grad)
    return w, torch.zeros(B, H, device=DEV), torch.randn(t, B, H, generator=g).to(DEV)


def _variant(name):
    from torch_scan_hop import scan

    if name == "loop":
        return run_loop
    unroll = None if name.startswith("ours") and name.endswith("default") else 1
    return lambda w, c0, xs: scan(cell(w), c0, xs, unroll=unroll)


def _runner(fn, args, train):
    if not train:
        return lambda: fn(*args)

    def step():
        c, ys = fn(*args)
        (c.square().sum() + ys.sin().sum()).backward()
    return step


def first_child(name, t, train):
    """One variant's first call in this fresh process (after a warm-up compile), with a breakdown."""
    from torch._dynamo.utils import compilation_time_metrics

    torch.compile(lambda a: torch.tanh(a) + 1)(torch.ones(3, device=DEV))
    compilation_time_metrics.clear()
    run = _sync_call(_runner(torch.compile(_variant(name)), _rnn_inputs(t, train), train))
    prof = os.environ.get("SCAN_BENCH_PROFILE") if name == "ours-default" else None
    if prof:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    t0 = time.perf_counter()
    run()
    first = time.perf_counter() - t0
    if prof:
        import pstats
        profiler.disable()
        with open(f"{prof}-{t}-{int(train)}.txt", "w") as f:
            pstats.Stats(profiler, stream=f).sort_stats("cumulative").print_stats(60)
    phases = {k: round(sum(v), 2) for k, v in compilation_time_metrics.items() if sum(v) > 0.2}
    cache = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    kernels = {"triton": 0, "cpp": 0}
    for root, _, files in os.walk(cache):
        for f in files:
            if f.endswith(".py"):
                text = open(os.path.join(root, f), errors="replace").read()
                if "def call(" in text:
                    kernels["triton"] += text.count("async_compile.triton(")
                    kernels["cpp"] += text.count("async_compile.cpp")
    print(json.dumps({"first": first, "phases": phases, "kernels": kernels}))


def part_first(lengths):
    """Every (variant, T, fwd/train) first call in a process of its own, all at once (16 cores)."""
    jobs, caches = {}, []
    for train in (False, True):
        for t in lengths:
            for name in ("ours-default", "ours-unroll1", "loop"):
                if name == "loop" and t > 64:
                    continue  # an unrolled loop of 256 steps compiles for minutes
                cache = tempfile.TemporaryDirectory()
                caches.append(cache)
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache.name, "TORCHINDUCTOR_COMPILE_THREADS": "1"}
                cmd = [sys.executable, __file__, "--first-child", name, str(t), str(int(train))]
                jobs[(train, t, name)] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                          text=True, env=env)
    rows, details = {}, []
    for (train, t, name), job in jobs.items():
        try:
            out, err = job.communicate(timeout=400)
        except subprocess.TimeoutExpired:
            job.kill()
            out, err = "", "timed out after 400 s"
        row = rows.setdefault((train, t), [t, "train" if train else "fwd", "-", "-", "-"])
        col = 2 + ("ours-default", "ours-unroll1", "loop").index(name)
        if job.returncode:
            row[col] = "failed"
            details.append(f"{name} T={t} train={train}: {err[-1500:]}")
            continue
        res = json.loads(out.strip().splitlines()[-1])
        row[col] = f"{res['first']:.1f}"
        details.append(f"{name} T={t} train={train}: kernels {res['kernels']} phases {res['phases']}")
    for cache in caches:
        cache.cleanup()
    print(f"first call (s) under inductor on {_device_name()}, tanh RNN H={H} B={B}; all variants "
          "at once, each a process of its own, one compile thread each")
    print_table(["T", "what", "ours (default)", "ours unroll=1", "compiled loop"], list(rows.values()))
    print("\n".join(details))


def _best_ms(times):
    return {k: min(v) * 1e3 for k, v in times.items()}


def part_steady(lengths):
    from torch_scan_hop import scan

    rows = []
    for t in lengths:
        args = _rnn_inputs(t, False)
        runs = {}
        with torch.no_grad():
            for name in ("ours-default", "ours-unroll1", "loop"):
                if name == "loop" and t > 64:
                    continue
                torch._dynamo.reset()
                f = torch.compile(_variant(name))
                runs[name] = _sync_call(lambda f=f: f(*args))
                runs[name]()
            try:
                g = torch.compile(_variant("ours-default"), mode="reduce-overhead")
                for _ in range(3):
                    g(*args)
                runs["ours-cudagraphs"] = _sync_call(lambda: g(*args))
            except Exception as e:  # noqa: BLE001 - reported in the table
                print(f"T={t} reduce-overhead failed: {type(e).__name__}: {str(e)[:300]}")
            runs["eager ours no-grad"] = _sync_call(lambda: scan(cell(args[0]), args[1], args[2]))
            runs["eager loop no-grad"] = _sync_call(lambda: run_loop(*args))
        targs = _rnn_inputs(t, True)
        runs["eager ours train"] = _sync_call(_runner(_variant("ours-unroll1"), targs, True))
        runs["eager loop train"] = _sync_call(_runner(run_loop, targs, True))
        best = _best_ms(interleaved_times(runs, repeat=15))
        loop = best.get("loop")
        rows.append([t] + [f"{best[k]:.3f}" if k in best else "-" for k in
                           ("ours-default", "ours-unroll1", "ours-cudagraphs", "loop")]
                    + [f"{best['ours-default'] / loop:.2f}x" if loop else "-",
                       f"{best['eager ours train'] / best['eager loop train']:.2f}x",
                       f"{best['eager ours no-grad'] / best['eager loop no-grad']:.2f}x"])
    print(f"steady (ms, best of 15 interleaved rounds) on {_device_name()}, tanh RNN H={H} B={B}")
    print_table(["T", "inductor ours", "unroll=1", "reduce-overhead", "compiled loop", "ours/loop",
                 "eager train ours/loop", "eager no-grad ours/loop"], rows)


_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
          "cudaMemcpyAsync", "cuMemcpyDtoH", "cudaStreamIsCapturing")
_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def _profile_call(call, calls=5):
    """Counts per call of one warm callable under torch.profiler: kernel launches, graph
    launches, host syncs (by the runtime call's name), and the GPU's kernel time (us)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        call()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
    counts = {"launches": 0, "graphs": 0, "syncs": 0, "kernel_us": 0.0}
    for ev in prof.events():
        name = ev.name
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            counts["kernel_us"] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        elif name in _LAUNCHES:
            counts["launches"] += 1
        elif name.startswith("cudaGraphLaunch"):
            counts["graphs"] += 1
        elif name.startswith(_SYNCS) and name != "cudaStreamIsCapturing":
            counts["syncs"] += 1
    return {k: v / calls for k, v in counts.items()}


def part_steps(lengths):
    from torch_scan_hop import scan

    rows = []
    for t in lengths:
        args = _rnn_inputs(t, False)
        with torch.no_grad():
            variants = {"eager loop": lambda: run_loop(*args),
                        "eager ours": lambda: scan(cell(args[0]), args[1], args[2])}
            torch._dynamo.reset()
            f = torch.compile(_variant("ours-default"))
            variants["inductor ours"] = lambda: f(*args)
            g = torch.compile(_variant("ours-default"), mode="reduce-overhead")
            variants["reduce-overhead ours"] = lambda: g(*args)
            if t <= 64:
                h = torch.compile(_variant("loop"))
                variants["inductor loop"] = lambda: h(*args)
            for name, fn in variants.items():
                try:
                    prof = _profile_call(fn)
                    best = min(interleaved_times({name: _sync_call(fn)}, repeat=10)[name])
                except Exception as e:  # noqa: BLE001 - reported in the table
                    print(f"T={t} {name} failed: {type(e).__name__}: {str(e)[:300]}")
                    continue
                rows.append([t, name, f"{best * 1e6 / t:.2f}", f"{prof['kernel_us'] / t:.2f}",
                             f"{prof['launches'] / t:.1f}", f"{prof['graphs']:.0f}", f"{prof['syncs']:.0f}"])
    print(f"per step on {_device_name()}, tanh RNN H={H} B={B}, no grad: wall us/step (best of 10) vs "
          "the GPU's kernel time per step (profiler), launches per step, graph launches and host syncs per call")
    print_table(["T", "variant", "wall us/step", "kernel us/step", "launches/step", "graph launches/call",
                 "syncs/call"], rows)


def _mlp(d):
    torch.manual_seed(0)
    ws = [(torch.randn(d, d, device=DEV) * d ** -0.5).requires_grad_() for _ in range(4)]

    def body(c, x):
        h = c + x
        for w in ws:
            h = torch.tanh(h @ w)
        return h, h.sum(-1)
    return body


def _peak_and_time(fn):
    fn()  # warm-up (and compile)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20, (time.perf_counter() - t0) * 1e3


def part_peaks(d=1024, batch=64, t=128):
    from torch.utils.checkpoint import checkpoint

    from torch_scan_hop import scan

    body = _mlp(d)
    c0, xs = torch.zeros(batch, d, device=DEV), torch.randn(t, batch, d, device=DEV)

    def loop(ckpt):
        c, ys = c0, []
        for x in xs:
            c, y = checkpoint(body, c, x, use_reentrant=False) if ckpt else body(c, x)
            ys.append(y)
        (c.sum() + torch.stack(ys).sum()).backward()

    def ours(remat):
        c, ys = scan(body, c0, xs, remat=remat)
        (c.sum() + ys.sum()).backward()

    compiled = torch.compile(ours)
    rows = [["loop", *_peak_and_time(lambda: loop(False)), "", ""],
            ["loop + checkpoint per step", *_peak_and_time(lambda: loop(True)), "", ""]]
    for remat in ("save_all", "recompute_all", "min_cut", "sqrt"):
        rows.append([remat, *_peak_and_time(lambda r=remat: ours(r)), *_peak_and_time(lambda r=remat: compiled(r))])
    print(f"peak MiB / time ms of one training step on {_device_name()}, MLP d={d} B={batch} T={t}")
    print_table(["policy", "eager peak", "eager ms", "compiled peak", "compiled ms"],
                [[r[0]] + [f"{v:.1f}" if isinstance(v, float) else v for v in r[1:]] for r in rows])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--parts", default="first,steady,peaks")
    p.add_argument("--lengths", default="16,256")
    p.add_argument("--first-child", nargs=3)
    a = p.parse_args()
    if a.first_child:
        name, t, train = a.first_child
        return first_child(name, int(t), bool(int(train)))
    if DEV == "cuda" and not torch.cuda.is_available():
        print("benchmarks/cuda.py: no CUDA device here; nothing measured")
        return
    lengths = [int(v) for v in a.lengths.split(",")]
    parts = {"first": lambda: part_first(lengths), "steady": lambda: part_steady(lengths),
             "steps": lambda: part_steps(lengths), "peaks": part_peaks}
    for part in a.parts.split(","):
        parts[part]()
        sys.stdout.flush()


if __name__ == "__main__":
    main()
