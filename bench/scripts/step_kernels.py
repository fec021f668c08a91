#!/usr/bin/env python3
"""Kernel time per training step from ncu's --csv output (gpu__time_duration.sum), by kernel.

    step_kernels.py NCU_CSV [PREV_NCU_CSV] [--steps N] [--top K]

Sums each kernel's durations over the log and divides by N (the steps the profiled command ran:
train_bench --steps 1 runs 3 warm-up steps and 1 timed, so N = 4 by default). Kernels are
named by their function (template arguments and parameter lists dropped, the walk policy of
the tiled kernels kept), so the lines of two builds compare. With a second log (the parent's),
prints both columns and the change, largest first.
"""
import argparse
import collections
import csv
import re

UNITS = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0}


def short_name(name):
    # The walk / key policy names which branch a shared kernel served (selected or window).
    policy = re.search(r"\b(\w+(?:Walk|Policy))\b", name)
    prev = None
    while prev != name:
        prev = name
        name = re.sub(r"<[^<>]*>", "", name)
        name = re.sub(r"\([^()]*\)", "", name)
    name = name.replace("void ", "").replace("(anonymous namespace)::", "").replace("<unnamed>::", "")
    name = name.replace("::::", "::")
    return (name + (f" [{policy.group(1)}]" if policy else ""))[:100]


def per_kernel(path, steps):
    rows = [line for line in open(path, errors="replace") if line.startswith('"')]
    total, launches = collections.defaultdict(float), collections.Counter()
    for r in csv.DictReader(rows):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        ms = float(r["Metric Value"].replace(",", "")) * UNITS.get(r.get("Metric Unit", "ns"), 1e-6)
        key = short_name(r["Kernel Name"])
        total[key] += ms / steps
        launches[key] += 1 / steps
    return total, launches


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("prev", nargs="?")
    ap.add_argument("--steps", type=float, default=4)
    ap.add_argument("--top", type=int, default=60)
    a = ap.parse_args()
    this, this_n = per_kernel(a.csv, a.steps)
    if not a.prev:
        print(f"total {sum(this.values()):.2f} ms a step, {sum(this_n.values()):.0f} launches")
        for k, v in sorted(this.items(), key=lambda kv: -kv[1])[: a.top]:
            print(f"{v:8.3f} ms {this_n[k]:6.1f}x  {k}")
        return
    prev, prev_n = per_kernel(a.prev, a.steps)
    print(f"total {sum(prev.values()):.2f} -> {sum(this.values()):.2f} ms a step, "
          f"{sum(prev_n.values()):.0f} -> {sum(this_n.values()):.0f} launches")
    keys = sorted(set(this) | set(prev), key=lambda k: -max(this.get(k, 0), prev.get(k, 0)))
    print(f"{'prev ms':>8} {'this ms':>8} {'change':>8}  launches  kernel")
    for k in keys[: a.top]:
        p, t = prev.get(k, 0.0), this.get(k, 0.0)
        print(f"{p:8.3f} {t:8.3f} {t - p:+8.3f}  {prev_n.get(k, 0):4.0f}->{this_n.get(k, 0):<4.0f} {k}")


if __name__ == "__main__":
    main()
