"""Decode attention under the microscope: which arithmetic lands on the full forward's bits,
and what each variant costs.

Fidelity: for random q/K/V at the 4B's head shape, the reference is the last row of
SDPA's flash causal forward over the whole sequence (what native's full forward
computes for that position on the platform's torch). Against it: SDPA's flash decode
(native's cached decode: one query row, K/V repeated to every head as Transformers
does), cuDNN attention's full forward (what newer torch picks on Hopper), our kernel
in several variants, and float64. Reported per variant: fraction of output elements
bit-equal to the reference, mean and max |diff|.

Timing: each variant as a CUDA graph over 36 layer copies of the cache (KV read from
HBM, as in a decode step), at the engine's capacity for the public shapes.

    python scripts/gpu_attn_probe.py [--out FILE]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "engine"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_decode_attention import _capture, _time_graph  # noqa: E402
from fqkernels.decode_attention import decode_attention, decode_attention_plan  # noqa: E402

H, KVH, D = 32, 8, 128
G = H // KVH
SCALE = D**-0.5
LAYERS = 36
REPLAYS = 30

VARIANTS = {
    "default": {},
    "oldest_first": {"flash_order": False},
    "splits1": {"num_splits": 1},
    "splits2": {"num_splits": 2},
    "splits4": {"num_splits": 4},
    "splits8": {"num_splits": 8},
    "bn128": {"block_n": 128},
}


def _capacity(length: int) -> int:
    return ((length + 130 + 255) // 256) * 256


def fidelity(batch: int, length: int, q_scale: float, seed: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q_all = (torch.randn((batch, H, length, D), generator=gen, device="cuda") * q_scale).to(torch.bfloat16)
    k = torch.randn((batch, KVH, length, D), generator=gen, device="cuda").to(torch.bfloat16)
    v = torch.randn((batch, KVH, length, D), generator=gen, device="cuda").to(torch.bfloat16)
    k_rep, v_rep = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        full = F.scaled_dot_product_attention(q_all, k_rep, v_rep, is_causal=True, scale=SCALE)[:, :, -1]
        native = F.scaled_dot_product_attention(q_all[:, :, -1:], k_rep, v_rep, scale=SCALE)[:, :, 0]
    extra = {"native_decode": native}
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            extra["cudnn_full"] = F.scaled_dot_product_attention(
                q_all, k_rep, v_rep, is_causal=True, scale=SCALE)[:, :, -1]
    except RuntimeError as exc:  # no cuDNN attention on this build
        print("cudnn attention unavailable:", str(exc).splitlines()[0][:120])
    q = q_all[:, :, -1].contiguous()
    cap = _capacity(length)
    kc = torch.zeros((batch, KVH, cap, D), dtype=torch.bfloat16, device="cuda")
    vc = torch.zeros_like(kc)
    kc[:, :, :length], vc[:, :, :length] = k, v
    lengths = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    scores = torch.einsum("bhd,bhnd->bhn", q.double(), k_rep.double()) * SCALE
    truth = torch.einsum("bhn,bhnd->bhd", torch.softmax(scores, -1), v_rep.double())
    outs = dict(extra)
    for name, kw in VARIANTS.items():
        outs[name] = decode_attention(q, kc, vc, lengths, SCALE, **kw)
    row = {"batch": batch, "length": length, "q_scale": q_scale, "capacity": cap,
           "splits": decode_attention_plan(batch, H, KVH, cap, D).num_splits,
           "full_vs_truth_mean": (full.double() - truth).abs().mean().item()}
    for name, out in outs.items():
        diff = (out.float() - full.float()).abs()
        row[name] = {
            "equal_frac": round((out == full).float().mean().item(), 4),
            "mean_abs": diff.mean().item(),
            "max_abs": diff.max().item(),
            "vs_truth_mean": (out.double() - truth).abs().mean().item(),
        }
    return row


def timing(batch: int, length: int, extra: dict) -> dict:
    cap = _capacity(length)
    kc = torch.randn((LAYERS, batch, KVH, cap, D), device="cuda").to(torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn((batch, H, D), device="cuda").to(torch.bfloat16)
    lengths = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    row = {"batch": batch, "length": length, "capacity": cap,
           "kv_floor_us": 2 * batch * KVH * length * D * 2 / 4.8e12 * 1e6}
    for name, kw in {**VARIANTS, **extra}.items():
        if "warps" in kw or "stages" in kw:
            base = decode_attention_plan(batch, H, KVH, cap, D, kw.get("num_splits"))
            kw = {"plan": dataclasses.replace(base, num_warps=kw.get("warps", base.num_warps),
                                              num_stages=kw.get("stages", base.num_stages))}

        def run(kw=kw):
            for layer in range(LAYERS):
                decode_attention(q, kc[layer], vc[layer], lengths, SCALE, out=out, **kw)
        row[name] = round(_time_graph(_capture(run), REPLAYS) * 1e3 / LAYERS, 2)
    del kc, vc
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "attn_probe.json"))
    args = ap.parse_args()
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "fidelity": [], "timing": []}
    for i, (b, n, a) in enumerate([(1, 540, 1.0), (1, 540, 3.0), (4, 2080, 2.0), (16, 576, 2.0),
                                   (16, 576, 4.0), (1, 2080, 2.0)]):
        row = fidelity(b, n, a, seed=i)
        report["fidelity"].append(row)
        print("fid", b, n, a, "splits", row["splits"], {k: (v["equal_frac"], round(v["mean_abs"], 6))
              for k, v in row.items() if isinstance(v, dict)}, flush=True)
    splits_sweep = {"splits16": {"num_splits": 16}, "splits1_oldest_first": {"num_splits": 1, "flash_order": False}}
    splits_sweep.update({f"splits1_w{w}_s{st}": {"num_splits": 1, "warps": w, "stages": st}
                         for w in (4, 8) for st in (2, 3, 4) if (w, st) != (4, 2)})
    splits_sweep.update({f"splits{n}_w8": {"num_splits": n, "warps": 8} for n in (2, 4)})
    splits_sweep.update({f"bn128_splits{s}": {"block_n": 128, "num_splits": s} for s in (2, 4, 8)})
    for b, n in [(1, 540), (4, 2080), (16, 576)]:
        row = timing(b, n, splits_sweep)
        report["timing"].append(row)
        print("time", row, flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
