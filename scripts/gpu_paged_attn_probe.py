"""The paged decode attention against the row one (fq_slots' page_size, a server's --block-size),
at the shapes where session 12's run 4 found it slower (batch 16, head_dim 128: the FA2 path,
60.6 against 36.0 us): each case timed as a CUDA graph over enough layers that K/V stream from
HBM, the paged form under several pipeline depths (num_stages; the plan is otherwise the
default's), each checked bit for bit against the row form. The paged form runs with both of the
plan's page_ids: "tile" (each key tile loads its page index from the table inside the loop, the
default; depths 2-5) and "split" (each program loads its split's page indices once, before the
loop; depths 3-5), to see whether the table load in the loop is what costs the time.

    python scripts/gpu_paged_attn_probe.py [--out PATH]

Needs a CUDA device. Writes a list of {case, form, page_ids, num_stages, us, same_bits} rows to
JSON (page_ids None for the row form; "error" instead of us / same_bits where a launch failed).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "engine"))
from fq_ops import _time_over  # noqa: E402
from fqkernels.decode_attention import decode_attention, decode_attention_plan  # noqa: E402

# (batch, heads, kv heads, head_dim, capacity, page)
CASES = [(16, 32, 8, 128, 2048, 64), (16, 32, 8, 128, 2048, 128), (4, 32, 8, 128, 4096, 64),
         (1, 32, 8, 128, 8192, 64), (16, 16, 4, 256, 2048, 64), (1, 16, 4, 256, 8192, 64)]
LAYERS = 24


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "paged_attn_probe.json"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for batch, heads, kvh, dim, cap, page in CASES:
        gen = torch.Generator(device=dev).manual_seed(batch * cap + page)
        q = torch.randn(batch, heads, dim, device=dev, generator=gen).bfloat16()
        k = torch.randn(LAYERS, batch, kvh, cap, dim, device=dev, generator=gen).bfloat16()
        v = torch.randn(LAYERS, batch, kvh, cap, dim, device=dev, generator=gen).bfloat16()
        lengths = torch.full((batch,), cap, dtype=torch.int32, device=dev)
        width = cap // page
        # the same contents in pages, the table a shuffled permutation
        perm = torch.randperm(batch * width, device=dev, generator=gen).to(torch.int32)
        table = perm.view(batch, width)
        pool_k = torch.empty(LAYERS, batch * width, kvh, page, dim, dtype=torch.bfloat16, device=dev)
        pool_v = torch.empty_like(pool_k)
        for pool, rows_ in ((pool_k, k), (pool_v, v)):
            paged = rows_.view(LAYERS, batch, kvh, width, page, dim).transpose(2, 3).reshape(
                LAYERS, batch * width, kvh, page, dim)
            pool[:, table.reshape(-1).long()] = paged
        scale = dim ** -0.5
        plan = decode_attention_plan(batch, heads, kvh, cap, dim)
        want = decode_attention(q, k[0], v[0], lengths, scale)
        layers = list(range(LAYERS))      # each timed call one layer's attention, all layers in one graph
        base = _time_over(lambda i: decode_attention(q, k[i], v[i], lengths, scale), layers, 20)
        case = f"B{batch} H{heads}/{kvh} D{dim} C{cap} page{page}"
        rows.append({"case": case, "form": "rows", "page_ids": None, "num_stages": plan.num_stages,
                     "us": round(base, 2), "same_bits": True})
        print(json.dumps(rows[-1]), flush=True)
        for page_ids, depths in (("tile", (2, 3, 4, 5)), ("split", (3, 4, 5))):
            for stages in depths:
                p = dataclasses.replace(plan, num_stages=stages, page_ids=page_ids)
                row = {"case": case, "form": "paged", "page_ids": page_ids, "num_stages": stages}
                try:
                    got = decode_attention(q, pool_k[0], pool_v[0], lengths, scale, plan=p, block_table=table)
                    us = _time_over(lambda i: decode_attention(q, pool_k[i], pool_v[i], lengths, scale, plan=p,
                                                               block_table=table), layers, 20)
                    row.update(us=round(us, 2), same_bits=bool(torch.equal(got, want)))
                except Exception as exc:  # noqa: BLE001 - a depth that does not fit is reported, not fatal
                    row["error"] = str(exc)[:200]
                rows.append(row)
                print(json.dumps(row), flush=True)
        del k, v, pool_k, pool_v
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
