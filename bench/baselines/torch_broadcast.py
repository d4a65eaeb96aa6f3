#!/usr/bin/env python3
"""The usual non-colocated refit, written in PyTorch, as refit's reference baseline
(NeMo-RL's "packed broadcast").

One process per GPU, started with torch.multiprocessing: rank 0 is the trainer on GPU 0 and holds
every HF tensor whole (FSDP2 world size 1, or an already unsharded model); ranks 1..E are engine
ranks on GPUs 1..E, one NCCL group of 1 + E ranks (SGLang's convention: trainer 0 = rank 0). Per
bucket of at most --bucket-bytes (a bucket closes when the next tensor would overflow it; a tensor
larger than that gets a bucket of its own): the trainer casts each tensor to bf16, packs them flat
(torch.cat of uint8 views) into one of --buffers rotating buffers and broadcasts it from rank 0;
each engine rank receives into its own rotating buffer and unpacks every tensor into its own
HF-shaped bf16 tensor (a full copy per engine rank: no TP slicing and no layout fusion, so the
method is idealised) on a side stream, overlapping the next bucket's broadcast.

Idealised further: no HTTP, no pickling of metadata, no name mapping; both sides derive the bucket
composition once at setup from the same tensor list — `refit spec MODEL --json` (pass the refit
binary with --refit), so the baseline moves exactly the shapes refit moves.

Also times the bare broadcasts of the same bucket sizes over the same group (no cast, pack or
unpack): the wire limit of this method on these GPUs. After the timed refits every engine compares
an exact checksum of every tensor (int64 sum of its bf16 bits) with the trainer's.

Prints one JSON object (rank 0): median refit ms after --warmup refits, GB/s (engine bytes = 2 per
parameter / time), the raw broadcast's ms and GB/s, buckets, tensors, peak extra memory.

--device cpu runs the same code on the Gloo backend with host tensors (a smoke test; no streams).

  python3 bench/baselines/torch_broadcast.py --refit build/src/refit --model qwen3-8b \\
      --trainer-dtype float32 --engines 1 --json out.json
  python3 bench/baselines/torch_broadcast.py --device cpu --model tiny --engines 2
"""
import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def tiny_tensors(layers=2, hidden=64, inter=160, vocab=512, heads=4, kv_heads=2, head_dim=16):
    """A small Qwen-like parameter table for smoke tests without the refit binary."""
    t = [{"name": "model.embed_tokens.weight", "shape": [vocab, hidden]}]
    for i in range(layers):
        p = f"model.layers.{i}."
        t += [
            {"name": p + "input_layernorm.weight", "shape": [hidden]},
            {"name": p + "self_attn.q_proj.weight", "shape": [heads * head_dim, hidden]},
            {"name": p + "self_attn.k_proj.weight", "shape": [kv_heads * head_dim, hidden]},
            {"name": p + "self_attn.v_proj.weight", "shape": [kv_heads * head_dim, hidden]},
            {"name": p + "self_attn.o_proj.weight", "shape": [hidden, heads * head_dim]},
            {"name": p + "post_attention_layernorm.weight", "shape": [hidden]},
            {"name": p + "mlp.gate_proj.weight", "shape": [inter, hidden]},
            {"name": p + "mlp.up_proj.weight", "shape": [inter, hidden]},
            {"name": p + "mlp.down_proj.weight", "shape": [hidden, inter]},
        ]
    t += [{"name": "model.norm.weight", "shape": [hidden]},
          {"name": "lm_head.weight", "shape": [vocab, hidden]}]
    return t


def load_tensors(args):
    if args.spec_json:
        with open(args.spec_json) as f:
            return json.load(f)["parameters"]
    if args.refit:
        out = subprocess.run([args.refit, "spec", args.model, "--json"], check=True,
                             capture_output=True, text=True).stdout
        return json.loads(out)["parameters"]
    if args.model == "tiny":
        return tiny_tensors()
    sys.exit(f"--model {args.model}: pass --refit BINARY (or --spec-json FILE); "
             "only 'tiny' is built in")


def make_buckets(tensors, bucket_bytes, elem_bytes=2):
    """[(tensor index, byte offset, bytes)] per bucket: a bucket closes when the next tensor would
    overflow it; a tensor larger than the buffer gets a bucket of its own."""
    buckets, cur, cur_bytes = [], [], 0
    for i, t in enumerate(tensors):
        b = numel(t["shape"]) * elem_bytes
        if cur and cur_bytes + b > bucket_bytes:
            buckets.append(cur)
            cur, cur_bytes = [], 0
        cur.append((i, cur_bytes, b))
        cur_bytes += b
    if cur:
        buckets.append(cur)
    return buckets


def bucket_bytes_of(bucket):
    return sum(n for _, _, n in bucket)


class Rank:
    """What one process of the group holds: its device, the rotating buffers, and (trainer) the
    weights or (engine) its bf16 parameters."""

    def __init__(self, rank, args, tensors, buckets):
        self.rank = rank
        self.args = args
        self.tensors = tensors
        self.buckets = buckets
        self.cuda = args.device == "cuda"
        self.dev = torch.device("cuda", rank) if self.cuda else torch.device("cpu")
        nbuf = max(args.buffers, 1)
        biggest = max(bucket_bytes_of(b) for b in buckets)
        self.bufs = [torch.empty(biggest, dtype=torch.uint8, device=self.dev) for _ in range(nbuf)]
        gen = torch.Generator(device=self.dev)
        gen.manual_seed(1234)
        if rank == 0:
            tdt = DTYPES[args.trainer_dtype]
            self.weights = []
            for t in tensors:
                w = torch.empty(t["shape"], dtype=tdt, device=self.dev)
                w.uniform_(-0.1, 0.1, generator=gen)
                self.weights.append(w)
        else:
            self.params = [torch.zeros(t["shape"], dtype=torch.bfloat16, device=self.dev)
                           for t in tensors]
            if self.cuda:
                self.side = [torch.cuda.Stream(device=self.dev) for _ in range(nbuf)]
                self.unpacked = [None] * nbuf  # event: the buffer's last unpack finished
        self.one = torch.ones(1, device=self.dev)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.dev)

    def fence(self):
        """Every rank's work done: a device sync, then a 1-element all-reduce (and its sync)."""
        self.sync()
        self.one.fill_(1)
        dist.all_reduce(self.one)
        self.sync()

    # ---- trainer ----
    def pack_parts(self, bucket):
        return [self.weights[t].to(torch.bfloat16).reshape(-1).view(torch.uint8)
                for t, _, _ in bucket]

    def send_refit(self):
        nbuf = self.args.buffers
        works = [None] * max(nbuf, 1)
        for b, bucket in enumerate(self.buckets):
            nbytes = bucket_bytes_of(bucket)
            if nbuf == 0:  # a fresh flat tensor per bucket (the allocator keeps it alive)
                flat = torch.cat(self.pack_parts(bucket))
                dist.broadcast(flat, src=0)
                continue
            k = b % nbuf
            if works[k] is not None:
                works[k].wait()  # the stream packing next waits for that buffer's broadcast
            out = self.bufs[k][:nbytes]
            torch.cat(self.pack_parts(bucket), out=out)
            works[k] = dist.broadcast(out, src=0, async_op=True)
        for w in works:
            if w is not None:
                w.wait()

    # ---- engine ----
    def unpack(self, bucket, buf):
        for t, off, n in bucket:
            self.params[t].view(-1).copy_(buf[off:off + n].view(torch.bfloat16))

    def receive_refit(self):
        nbuf = max(self.args.buffers, 1)
        for b, bucket in enumerate(self.buckets):
            k = b % nbuf
            buf = self.bufs[k][:bucket_bytes_of(bucket)]
            if not self.cuda:
                dist.broadcast(buf, src=0)
                self.unpack(bucket, buf)
                continue
            if self.unpacked[k] is not None:  # the broadcast must not overwrite an unpack in flight
                torch.cuda.current_stream(self.dev).wait_event(self.unpacked[k])
            work = dist.broadcast(buf, src=0, async_op=True)
            with torch.cuda.stream(self.side[k]):
                work.wait()  # this side stream waits for the broadcast
                self.unpack(bucket, buf)
                ev = torch.cuda.Event()
                ev.record()
                self.unpacked[k] = ev
        # fence() synchronises the device, which includes the side streams.

    def refit(self):
        if self.rank == 0:
            self.send_refit()
        else:
            self.receive_refit()

    def raw_pass(self):
        """The same broadcasts of the same bucket sizes, nothing else."""
        nbuf = max(self.args.buffers, 1)
        works = []
        for b, bucket in enumerate(self.buckets):
            buf = self.bufs[b % nbuf][:bucket_bytes_of(bucket)]
            works.append(dist.broadcast(buf, src=0, async_op=True))
        for w in works:
            w.wait()

    def timed(self, fn):
        self.fence()
        start = time.perf_counter()
        fn()
        self.fence()
        return (time.perf_counter() - start) * 1e3

    def checksums(self, tensors):
        return torch.stack([t.to(torch.bfloat16).view(torch.int16).sum(dtype=torch.int64)
                            for t in tensors])

    def check(self):
        """Number of engine tensors whose bits differ from the trainer's bf16 cast (summed over
        the engine ranks)."""
        if self.rank == 0:
            sums = self.checksums(self.weights)
        else:
            sums = torch.empty(len(self.tensors), dtype=torch.int64, device=self.dev)
        dist.broadcast(sums, src=0)
        bad = torch.zeros(1, dtype=torch.int64, device=self.dev)
        if self.rank != 0:
            bad += (self.checksums(self.params) != sums).sum()
        dist.all_reduce(bad)
        return int(bad.item())


def worker(rank, world, args, tensors, buckets):
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo",
                            init_method=f"tcp://{args.addr}:{args.port}", rank=rank,
                            world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout_s))
    t0 = time.perf_counter()
    r = Rank(rank, args, tensors, buckets)
    r.fence()
    setup_s = time.perf_counter() - t0
    base = torch.cuda.memory_allocated(r.dev) if r.cuda else 0
    if r.cuda:
        torch.cuda.reset_peak_memory_stats(r.dev)
    times, raw = [], []
    for step in range(args.warmup + args.steps):
        ms = r.timed(r.refit)
        if step >= args.warmup:
            times.append(ms)
    extra = torch.cuda.max_memory_allocated(r.dev) - base if r.cuda else 0
    for step in range(args.warmup + args.steps if args.raw else 0):
        ms = r.timed(r.raw_pass)
        if step >= args.warmup:
            raw.append(ms)
    # The raw passes overwrote the engines' buffers, not their parameters: check them now.
    mismatched = r.check()
    extras = torch.tensor([extra], dtype=torch.int64, device=r.dev)
    gathered = [torch.zeros_like(extras) for _ in range(world)]
    dist.all_gather(gathered, extras)
    if rank == 0:
        payload = sum(numel(t["shape"]) for t in tensors) * 2
        ms = statistics.median(times)
        out = {
            "method": "torch packed broadcast (idealised)",
            "model": args.model,
            "device": args.device,
            "trainer_dtype": args.trainer_dtype,
            "engines": world - 1,
            "gpus": world if args.device == "cuda" else 0,
            "tensors": len(tensors),
            "buckets": len(buckets),
            "bucket_bytes": args.bucket_bytes,
            "buffers": args.buffers,
            "bytes_per_refit": payload,
            "ms": ms,
            "ms_all": times,
            "gbps": payload / (ms * 1e-3) / 1e9,
            "mismatched_tensors": mismatched,
            "check_ok": mismatched == 0,
            "trainer_extra_bytes": int(gathered[0].item()),
            "engine_extra_bytes": max([int(g.item()) for g in gathered[1:]] or [0]),
            "setup_s": setup_s,
            "torch": torch.__version__,
        }
        if raw:
            raw_ms = statistics.median(raw)
            out.update({"raw_ms": raw_ms, "raw_ms_all": raw,
                        "raw_gbps": payload / (raw_ms * 1e-3) / 1e9,
                        "ratio_to_raw": raw_ms / ms})
        if r.cuda:
            out["gpu"] = torch.cuda.get_device_name(r.dev)
        print(json.dumps(out), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)
    r.fence()
    dist.destroy_process_group()
    if rank == 0 and mismatched:
        sys.exit(f"torch_broadcast: {mismatched} engine tensor(s) differ from the trainer's")


def free_port(addr):
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="refit preset (with --refit) or 'tiny'")
    ap.add_argument("--refit", help="refit binary: the tensor list comes from `refit spec --json`")
    ap.add_argument("--spec-json", help="a saved `refit spec MODEL --json` instead of --refit")
    ap.add_argument("--trainer-dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--engines", type=int, default=1, help="engine ranks (GPUs 1..E)")
    ap.add_argument("--bucket-bytes", type=int, default=512 << 20)
    ap.add_argument("--buffers", type=int, default=2,
                    help="rotating buffers (0: a fresh torch.cat per bucket)")
    ap.add_argument("--steps", type=int, default=5, help="timed refits (median)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--no-raw", dest="raw", action="store_false",
                    help="skip the bare broadcast passes")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--addr", default=os.environ.get("MASTER_ADDR", "127.0.0.1"))
    ap.add_argument("--port", type=int, default=0, help="0: a free port")
    ap.add_argument("--timeout-s", type=int, default=300)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.engines < 1 or args.buffers < 0 or args.steps < 1 or args.warmup < 0:
        sys.exit("--engines and --steps must be >= 1, --buffers and --warmup >= 0")
    world = 1 + args.engines
    if args.device == "cuda" and torch.cuda.device_count() < world:
        sys.exit(f"--engines {args.engines} needs {world} GPUs; "
                 f"{torch.cuda.device_count()} visible")
    tensors = load_tensors(args)
    buckets = make_buckets(tensors, args.bucket_bytes)
    if args.port == 0:
        args.port = free_port(args.addr)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = args.addr, str(args.port)
    try:
        mp.spawn(worker, args=(world, args, tensors, buckets), nprocs=world, join=True)
    except Exception as e:  # a rank failed: its traceback is above
        sys.exit(f"torch_broadcast: {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
