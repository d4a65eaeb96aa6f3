"""FP8 engines on a GPU (docs/fp8.md), with torch as the reference.

  python3 fp8_torch.py exact DUMP BLOCK_ROWS BLOCK_COLS
      Every quantized weight of a `refit run --dump` (generation.layout hf: the engine holds the
      checkpoint's names) against torch's quantizer on the GPU: amax per block, scale = amax / 448
      (1 where that is 0), (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn). Codes and
      scales must match bit for bit; bf16 tensors must equal the trainer's values rounded to bf16.
  python3 fp8_torch.py baseline MODEL_JSON
      The torch baseline: blockwise quantize of every linear weight of a model's shapes (bf16 on
      the GPU), timed; prints the median ms.
"""
import json
import statistics
import sys
import time

import torch
from safetensors.torch import load_file


def torch_quantize(x: torch.Tensor, br: int, bc: int):
    x = x.float()
    rows, cols = x.shape
    nbr, nbc = -(-rows // br), -(-cols // bc)
    pad = torch.zeros(nbr * br, nbc * bc, device=x.device)
    pad[:rows, :cols] = x
    blocks = pad.view(nbr, br, nbc, bc)
    amax = blocks.abs().amax(dim=(1, 3))
    # A tensor divisor: torch turns division by a Python scalar into a multiplication by its
    # reciprocal on CUDA, which is not amax / 448 in float32.
    scale = amax / torch.full_like(amax, 448.0)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.view(nbr * br, nbc * bc)[:rows, :cols].contiguous(), scale


def exact(dump: str, br: int, bc: int) -> int:
    trainer = load_file(f"{dump}/trainer.safetensors", device="cuda")
    engine = load_file(f"{dump}/engine-0.safetensors", device="cuda")
    quantized = bad = 0
    for name, x in trainer.items():
        e = engine[name]
        if e.dtype == torch.float8_e4m3fn:
            quantized += 1
            q, s = torch_quantize(x, br, bc)
            codes_ok = torch.equal(q.view(torch.uint8), e.view(torch.uint8))
            scales_ok = torch.equal(s, engine[name + "_scale_inv"].float())
            if not (codes_ok and scales_ok):
                bad += 1
                diff = (q.view(torch.uint8) != e.view(torch.uint8)).sum().item()
                print(f"MISMATCH {name}: codes differ at {diff} elements, scales equal: {scales_ok}")
        else:
            if not torch.equal(x.to(torch.bfloat16), e):
                bad += 1
                print(f"MISMATCH {name} (bf16)")
    print(f"exact: {quantized} quantized weights, {len(trainer) - quantized} bf16 tensors, "
          f"{bad} mismatches")
    return 1 if bad or quantized == 0 else 0


def baseline(model_json: str) -> int:
    c = json.load(open(model_json))
    h, layers, inter = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    shapes = [(q, h), (kv, h), (kv, h), (h, q), (inter, h), (inter, h), (h, inter)] * layers
    ws = [torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in shapes]
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for w in ws:
            torch_quantize(w, 128, 128)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    n = sum(w.numel() for w in ws)
    print(f"baseline: torch blockwise quantize of {n / 1e9:.2f} G elements: "
          f"{statistics.median(times) * 1e3:.1f} ms (median of 5)")
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "exact":
        sys.exit(exact(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
    sys.exit(baseline(sys.argv[2]))
