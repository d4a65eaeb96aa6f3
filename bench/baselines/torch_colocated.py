#!/usr/bin/env python3
"""The usual colocated refit, written in PyTorch, as refit's reference baseline.

Idealised: trainer and engine are two processes on one GPU; per bucket of at most --bucket-bytes
the trainer casts each tensor, concatenates them (torch.cat) into one flat buffer, sends its
CUDA IPC handle through torch.multiprocessing's reductions, and the engine copies every tensor
into its parameters and acknowledges before the next bucket. No HTTP, no pickling of metadata,
no name mapping: both sides derive the bucket composition and the destination views once at
setup, from the same layout file.

The layout file is what `zero_copy_bench --model M --dump-layout FILE` writes: the HF tensors
(name, shape) and the engine's TP-1 parameters with their pieces
[hf_tensor, src_row, src_col, rows, cols, dst_row, dst_col] (engine/engine_layout.h), so the
baseline moves exactly the shapes refit moves.

Prints one JSON object: median refit time, GB/s (engine bytes / time), peak extra GPU memory of
the trainer and the engine (torch.cuda.max_memory_allocated above the weights), and the
"one flat cast pass" floor over the same elements (measured after the engine exited).
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import reduce_tensor

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def matrix(shape):
    cols = shape[-1] if shape else 1
    return numel(shape) // cols, cols


def make_buckets(tensors, bucket_bytes, elem_bytes=2):
    """Tensors in order; a bucket closes when the next tensor would overflow it; a tensor larger
    than the buffer gets a bucket of its own (the rule of the usual implementations)."""
    buckets, cur, cur_bytes = [], [], 0
    for i, t in enumerate(tensors):
        b = numel(t["shape"]) * elem_bytes
        if cur and cur_bytes + b > bucket_bytes:
            buckets.append(cur)
            cur, cur_bytes = [], 0
        cur.append(i)
        cur_bytes += b
    if cur:
        buckets.append(cur)
    return buckets


def engine_main(layout, bucket_bytes, conn):
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    tensors = layout["tensors"]
    params = [torch.empty(p["shape"], dtype=torch.bfloat16, device=dev) for p in layout["params"]]
    # Destination views per HF tensor, computed once: (param view, src rows, src cols).
    dests = [[] for _ in tensors]
    for p, prm in zip(params, layout["params"]):
        rows, cols = matrix(prm["shape"])
        mat = p.view(rows, cols)
        for hf, sr, sc, r, c, dr, dc in prm["pieces"]:
            dests[hf].append((mat[dr:dr + r, dc:dc + c], sr, sc, r, c))
    buckets = make_buckets(tensors, bucket_bytes)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg[0] == "quit":
            return
        if msg[0] == "peak":  # before the spot check, which allocates
            conn.send(("engine_peak_extra", torch.cuda.max_memory_allocated() - base))
            continue
        if msg[0] == "check":  # compare one parameter with what the trainer sent
            _, idx = msg
            conn.send(("param", params[idx].double().sum().item()))
            continue
        _, b, rebuild_args = msg
        flat = rebuild_args[0](*rebuild_args[1])
        off = 0
        for t in buckets[b]:
            shape = tensors[t]["shape"]
            n = numel(shape)
            src = flat[off:off + n].view(matrix(shape))
            for view, sr, sc, r, c in dests[t]:
                view.copy_(src[sr:sr + r, sc:sc + c])
            off += n
        torch.cuda.current_stream().synchronize()
        del flat
        conn.send("ack")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", required=True)
    ap.add_argument("--trainer-dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--bucket-bytes", type=int, default=512 << 20)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    with open(args.layout) as f:
        layout = json.load(f)
    tensors = layout["tensors"]
    tdt = DTYPES[args.trainer_dtype]
    mp.set_start_method("spawn", force=True)
    parent, child = mp.Pipe()
    engine = mp.Process(target=engine_main, args=(layout, args.bucket_bytes, child))
    engine.start()

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    t_setup = time.time()
    weights = []
    for t in tensors:
        w = torch.empty(t["shape"], dtype=tdt, device=dev)
        w.uniform_(-0.1, 0.1)
        weights.append(w)
    buckets = make_buckets(tensors, args.bucket_bytes)
    assert parent.recv() == "ready"
    torch.cuda.synchronize()
    setup_s = time.time() - t_setup
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()

    def refit():
        for b, idx in enumerate(buckets):
            flat = torch.cat([weights[t].to(torch.bfloat16).flatten() for t in idx])
            parent.send(("bucket", b, reduce_tensor(flat)))
            assert parent.recv() == "ack"
            del flat

    times = []
    for step in range(args.steps + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        refit()
        torch.cuda.synchronize()
        if step > 0:
            times.append((time.perf_counter() - start) * 1e3)
    trainer_extra = torch.cuda.max_memory_allocated() - base
    parent.send(("peak",))
    _, engine_extra = parent.recv()
    # Spot check: the engine's first parameter holds what the trainer sent.
    parent.send(("check", 0))
    _, got = parent.recv()
    want = sum(weights[p[0]][p[1]:p[1] + p[3]].to(torch.bfloat16).double().sum().item()
               for p in layout["params"][0]["pieces"])
    parent.send(("quit",))
    engine.join()

    hf_elems = sum(numel(t["shape"]) for t in tensors)
    payload = hf_elems * 2
    # Floor: one flat cast pass over the same elements, after the engine freed its memory.
    del weights
    torch.cuda.empty_cache()
    src = torch.empty(hf_elems, dtype=tdt, device=dev)
    src.uniform_(-0.1, 0.1)
    dst = torch.empty(hf_elems, dtype=torch.bfloat16, device=dev)
    cast = []
    for i in range(6):
        torch.cuda.synchronize()
        s = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        if i > 0:
            cast.append((time.perf_counter() - s) * 1e3)
    ms = statistics.median(times)
    out = {
        "model": layout["model"],
        "trainer_dtype": args.trainer_dtype,
        "method": "torch colocated (idealised)",
        "ms": ms,
        "ms_all": times,
        "gbps": payload / (ms * 1e-3) / 1e9,
        "extra_bytes": trainer_extra + engine_extra,
        "trainer_extra_bytes": trainer_extra,
        "engine_extra_bytes": engine_extra,
        "flat_cast_ms": statistics.median(cast),
        "tensors": len(tensors),
        "buckets": len(buckets),
        "setup_s": setup_s,
        "spot_check_ok": abs(got - want) <= 1e-6 * max(1.0, abs(want)),
        "torch": torch.__version__,
    }
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
