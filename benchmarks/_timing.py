"""Shared helpers for the benchmark scripts: best-of-N wall time and a table printer."""
import time


def best_time(fn, repeat=5, number=1):
    """Best of ``repeat`` runs of ``number`` calls, in seconds per call."""
    fn()  # warm up
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - t0) / number)
    return best


def print_table(headers, rows):
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(str(h).rjust(w) for h, w in zip(headers, widths))
    print(line)
    print("-" * len(line))
    for r in rows:
        print("  ".join(str(c).rjust(w) for c, w in zip(r, widths)))


def interleaved_best_times(fns, repeat=5):
    """Best time per call of each fn in a dict, running them round-robin so that
    a burst of load on the machine hits every variant alike."""
    for fn in fns.values():
        fn()  # warm up (and fill caches)
    best = {name: float("inf") for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best
