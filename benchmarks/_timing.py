"""Shared helpers for the benchmark scripts: best-of-N wall time, paired ratios and a table printer."""
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


def interleaved_times(fns, repeat=5, clock=time.perf_counter):
    """Every round's time per call of each fn in a dict (``{name: [seconds per round]}``),
    running them round-robin, in alternating order, so that a burst of load on the
    machine hits every variant alike. ``clock=time.process_time`` measures CPU time
    (one-thread runs on a shared box)."""
    for fn in fns.values():
        fn()  # warm up (and fill caches)
    times = {name: [] for name in fns}
    order = list(fns)
    for _ in range(repeat):
        for name in order:
            t0 = clock()
            fns[name]()
            times[name].append(clock() - t0)
        order.reverse()
    return times


def interleaved_best_times(fns, repeat=5):
    """Best time per call of each fn in a dict (see ``interleaved_times``)."""
    return {name: min(ts) for name, ts in interleaved_times(fns, repeat).items()}


def paired_ratio(a, b, resamples=1000, seed=0):
    """Median over rounds of ``a[i] / b[i]`` (two variants timed in the same round) and a
    95% bootstrap interval of that median: on a noisy machine the ratio of two minima can
    land on either side of 1.0 by chance; an interval that excludes 1.0 does not."""
    import random
    import statistics

    ratios = [x / y for x, y in zip(a, b)]
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return statistics.median(ratios), meds[int(0.025 * resamples)], meds[int(0.975 * resamples) - 1]
