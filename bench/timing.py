"""The bench scripts' one clock: these machines are noisy, so every figure is a median of repeats."""

import statistics
import time

import torch


def median_time(fn, repeats=5):
    """Median wall time of fn() over repeats runs, GPU work included (bench/ scripts: these
    machines are noisy)."""
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
