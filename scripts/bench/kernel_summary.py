#!/usr/bin/env python3
"""Per-kernel time of one training step from an Nsight Compute CSV (kernel durations only):

    ncu --clock-control none --metrics gpu__time_duration.sum --csv --log-file k.csv \\
        loom run MANIFEST --set run.steps=2 ...
    python3 scripts/bench/kernel_summary.py k.csv [TOP]

The launches of the last step (from the last launch of the run's first kernel; with two
steps, the warm-up is left out) are grouped by kernel name, largest total first, with each
one's share of the step's kernel time and its launches.
"""
import collections
import csv
import sys

UNITS = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0}


def main():
    path, top = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40
    with open(path) as f:
        lines = [line for line in f if line.startswith('"')]
    rows = []
    for r in csv.DictReader(lines):
        if r.get("Metric Name") == "gpu__time_duration.sum":
            ms = float(r["Metric Value"].replace(",", "")) * UNITS.get(r.get("Metric Unit", "ns"), 1e-6)
            rows.append((int(r["ID"]), r["Kernel Name"], ms))
    rows.sort()
    # The last step begins at the last launch of the run's first kernel (a step's first
    # launch, e.g. the embedding lookup); half of the launches would not do: the steps
    # need not launch the same number of kernels, and the first step's optimizer launches
    # would count as the last one's.
    first = rows[0][1] if rows else ""
    start = max((i for i, r in enumerate(rows) if r[1] == first), default=0)
    step = rows[start:] if start > 0 else rows[len(rows) // 2:]
    total, count = collections.Counter(), collections.Counter()
    for _, name, ms in step:
        key = name.split("(")[0][:90]
        total[key] += ms
        count[key] += 1
    all_ms = sum(total.values())
    print(f"{len(rows)} kernels profiled; the last step: {len(step)} launches, {all_ms:.2f} ms of kernel time")
    for name, ms in total.most_common(top):
        print(f"{ms:8.3f} ms {100 * ms / all_ms:5.1f}% {count[name]:5d}x  {name}")


if __name__ == "__main__":
    main()
