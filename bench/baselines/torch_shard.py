#!/usr/bin/env python3
"""A plain PyTorch shard-to-shard refit on 2 GPUs: refit's baseline for the colocated transfer
plan (FSDP2 world 2 -> one engine of TP 2, trainer rank r and engine rank r on GPU r).

Idealised: one process drives both GPUs (no IPC handles, no control messages, no name mapping),
every tensor is handled in the order of `refit spec MODEL --json`, and the engine layout is
simplified to plain TP slices of the HF tensors (no fused qkv / gate_up, no vocabulary padding),
which moves the same bytes as refit's layout. Per tensor:
  - trainer rank r holds rows [r*ceil(R/2), ...) of the HF tensor (torch.chunk, FSDP2's Shard(0)),
    in the policy dtype, on GPU r;
  - column-parallel tensors (everything 2-D except the row-parallel ones): engine rank r keeps the
    same rows -> one local cast-copy on GPU r;
  - row-parallel tensors (o_proj, down_proj, MoE down_proj): engine rank r keeps columns
    [r*C/2, (r+1)*C/2) of every row -> its own rows cast-copied locally, the other rank's rows cast
    on their owner into a bf16 temporary and copied over NVLink (a stream per GPU);
  - 1-D tensors (norms) are replicated: both halves to both engine ranks the same way.
Prints one JSON object: median ms over --steps after one warm-up, bytes written, bytes over the
link per GPU.

  python3 bench/baselines/torch_shard.py --refit build/src/refit --model qwen3-8b \\
      --trainer-dtype float32 --json out.json
"""
import argparse
import json
import statistics
import subprocess
import time

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--refit", required=True, help="the refit binary (for `refit spec`)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--trainer-dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    spec = json.loads(subprocess.check_output([a.refit, "spec", a.model, "--json"]))
    dt = DTYPES[a.trainer_dtype]
    dev = [torch.device("cuda", 0), torch.device("cuda", 1)]
    streams = [torch.cuda.Stream(device=d) for d in dev]
    work = []  # (kind, trainer chunks, engine shards)
    written = [0, 0]
    link = [0, 0]
    for p in spec["parameters"]:
        shape = p["shape"]
        rows, cols = shape[0], 1  # 1-D: chunked along its only dimension
        if len(shape) >= 2:
            cols = shape[-1]
            rows = 1
            for s in shape[:-1]:
                rows *= s
        chunk = (rows + 1) // 2
        chunks = [torch.randn(max(0, min(chunk, rows - r * chunk)), cols, device=dev[r]).to(dt)
                  for r in range(2)]
        if len(shape) == 1:
            eng = [torch.empty(rows, cols, device=dev[r], dtype=torch.bfloat16) for r in range(2)]
            kind = "replicated"
        elif p["name"].endswith(ROW_PARALLEL):
            eng = [torch.empty(rows, cols // 2, device=dev[r], dtype=torch.bfloat16)
                   for r in range(2)]
            kind = "row"
        else:
            eng = [torch.empty(chunks[r].shape[0], cols, device=dev[r], dtype=torch.bfloat16)
                   for r in range(2)]
            kind = "col"
        for r in range(2):
            written[r] += eng[r].numel() * 2
        if kind != "col":
            for r in range(2):
                link[r] += chunks[1 - r].numel() * 2 // (2 if kind == "row" else 1)
        work.append((kind, chunks, eng))

    def refit():
        for kind, chunks, eng in work:
            for r in range(2):
                with torch.cuda.stream(streams[r]):
                    if kind == "col":
                        eng[r].copy_(chunks[r])
                        continue
                    lo = chunks[0].shape[0]
                    mine = slice(0, lo) if r == 0 else slice(lo, None)
                    theirs = slice(lo, None) if r == 0 else slice(0, lo)
                    cs = slice(r * (eng[r].shape[1]), (r + 1) * eng[r].shape[1])
                    eng[r][mine].copy_(chunks[r][:, cs] if kind == "row" else chunks[r])
                    # The other rank's rows: cast on their owner, then over NVLink.
                    with torch.cuda.stream(streams[1 - r]):
                        src = chunks[1 - r][:, cs] if kind == "row" else chunks[1 - r]
                        tmp = src.to(torch.bfloat16)
                        eng[r][theirs].copy_(tmp, non_blocking=True)
        for r in range(2):
            torch.cuda.synchronize(dev[r])

    refit()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        refit()
        times.append(time.perf_counter() - t0)
    out = {"model": a.model, "trainer_dtype": a.trainer_dtype, "ms": statistics.median(times) * 1e3,
           "times_ms": [t * 1e3 for t in times], "bytes_written_per_gpu": written,
           "bytes_over_link_per_gpu": link, "tensors": len(work)}
    print(json.dumps(out))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
