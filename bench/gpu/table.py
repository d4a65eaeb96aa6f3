#!/usr/bin/env python3
"""Prints the GPU benchmark table (markdown) from zero_copy_bench and torch_colocated JSON files.

usage: table.py BENCH_JSON... [--torch TORCH_JSON...]
"""
import json
import sys


def gib(b):
    return f"{b / 2**20:.1f} MiB" if b < 2**30 else f"{b / 2**30:.2f} GiB"


def main(argv):
    bench, torch_rows, mode = [], [], "bench"
    for a in argv:
        if a == "--torch":
            mode = "torch"
            continue
        try:
            with open(a) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            print(f"(skipping {a}: {e})", file=sys.stderr)
            continue
        if mode == "bench":
            bench.extend(data)
        else:
            torch_rows.append(data)
    torch_ms = {(t["model"], t["trainer_dtype"]): t for t in torch_rows}
    floor = {}
    for r in bench:
        if r["method"].startswith("floor: copy"):
            floor[(r["model"], r["trainer_dtype"])] = r["ms"]
    rows = [r for r in bench if not r["method"].startswith("diag")]
    for t in torch_rows:
        rows.append(t)
    print("| shape (trainer → bf16 engine) | method | ms | GB/s | floor / ms | speedup vs torch | extra GPU memory |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        key = (r["model"], r["trainer_dtype"])
        fl = floor.get(key)
        ratio = f"{fl / r['ms']:.2f}" if fl else "–"
        t = torch_ms.get(key)
        speed = f"{t['ms'] / r['ms']:.1f}×" if t and not r["method"].startswith("floor") else "–"
        extra = gib(r["extra_bytes"]) if "extra_bytes" in r else "–"
        print(f"| {r['model']} ({r['trainer_dtype']}, {r.get('tensors', '?')} tensors) | {r['method']} | "
              f"{r['ms']:.2f} | {r['gbps']:.0f} | {ratio} | {speed} | {extra} |")


if __name__ == "__main__":
    main(sys.argv[1:])
