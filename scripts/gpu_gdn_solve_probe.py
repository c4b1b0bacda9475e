"""Where the GDN prompt pass's solve kernel spends its time: the kernel timed whole and with
one stage at a time taken out (session 11's run 4 also timed the diagonal blocks' substitution
on [4, 16, 16] tiles here, before the kernel took it) (its results then wrong; only the time is read), at the 4B's
head shapes. Each variant is the kernel's own source with one stage replaced, compiled from
a temporary module.

    python scripts/gpu_gdn_solve_probe.py [--shapes 4x2048,16x8192] [--out PATH]

Needs a CUDA device. Writes {shape: {variant: us}} to JSON.
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import sys
import tempfile

import torch
import triton

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "engine"))
sys.path.insert(0, os.path.join(REPO, "scripts"))
from fqkernels import gdn  # noqa: E402

# variant -> (old text, new text) pairs applied to the kernel's source
VARIANTS = {
    "whole": [],
    "no_substitution": [("    for i in range(1, 16):\n", "    for i in range(1, 1):\n")],
    "no_block_products": [("    nt = _dot3(tl.where(same, 0.0, at), x, PREC)\n    m_inv = tl.trans(_dot3(_dot3(x, eye + _dot3(nt, nt, PREC), PREC), eye - nt, PREC))",
                           "    m_inv = tl.trans(x + tl.where(same, 0.0, at))")],
    "no_u_w": [("    u = _dot_f32_bf16(m_inv * beta[None, :], v)", "    u = tl.sum(m_inv, axis=1)[:, None] * v.to(tl.float32)"),
               ("    w = _dot_f32_bf16(m_inv * (beta * rk * tl.exp(gamma))[None, :], k)", "    w = tl.sum(m_inv, axis=1)[:, None] * k.to(tl.float32)")],
    "only_loads_stores": [("    for i in range(1, 16):\n", "    for i in range(1, 1):\n"),
                          ("    nt = _dot3(tl.where(same, 0.0, at), x, PREC)\n    m_inv = tl.trans(_dot3(_dot3(x, eye + _dot3(nt, nt, PREC), PREC), eye - nt, PREC))",
                           "    m_inv = tl.trans(x + tl.where(same, 0.0, at))"),
                          ("    u = _dot_f32_bf16(m_inv * beta[None, :], v)", "    u = tl.sum(m_inv, axis=1)[:, None] * v.to(tl.float32)"),
                          ("    w = _dot_f32_bf16(m_inv * (beta * rk * tl.exp(gamma))[None, :], k)", "    w = tl.sum(m_inv, axis=1)[:, None] * k.to(tl.float32)")],
}


def variant_kernel(name: str, edits: list, tmp: str):
    src = inspect.getsource(gdn._chunk_solve_kernel.fn)
    src = src[src.index("def "):]                       # without its decorator
    for old, new in edits:
        if old not in src:
            raise RuntimeError(f"variant {name}: {old[:60]!r} not in the kernel's source")
        src = src.replace(old, new)
    path = os.path.join(tmp, f"solve_{name}.py")
    with open(path, "w") as f:
        f.write("import triton\nimport triton.language as tl\nfrom fqkernels.gdn import *\n"
                "from fqkernels.gdn import _dot3, _dot_f32_bf16, _inv_norm, _tf32_head, _bf16_thirds\n\n"
                "@triton.jit\n" + src)
    spec = importlib.util.spec_from_file_location(f"solve_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod._chunk_solve_kernel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4x2048,16x8192")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gdn_solve_probe.json"))
    args = ap.parse_args()
    from bench_gdn import HK, HV, D, _inputs

    dev = torch.device("cuda")
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        kernels = {name: variant_kernel(name, edits, tmp) for name, edits in VARIANTS.items()}
        for shape in args.shapes.split(","):
            B, T = (int(x) for x in shape.split("x"))
            q, k, v, g, beta = _inputs(B, T, dev)
            nc = triton.cdiv(T, gdn.CHUNK)
            ws = B * HV * nc * gdn.CHUNK
            u = torch.empty((ws, D), dtype=torch.float32, device=dev)
            w = torch.empty((ws, D), dtype=torch.float32, device=dev)
            gamma = torch.empty((ws,), dtype=torch.float32, device=dev)
            rk = torch.empty((ws,), dtype=torch.float32, device=dev)
            row = {}
            for name, kern in kernels.items():
                def launch(kern=kern):
                    kern[(B * HV, nc)](k, v, g, beta, u, w, gamma, rk, T, nc, k.stride(0), k.stride(1), k.stride(2),
                                       v.stride(0), v.stride(1), v.stride(2), g.stride(0), g.stride(1), HV=HV,
                                       RATIO=HV // HK, C=gdn.CHUNK, DK=D, DV=D, PREC=gdn._PREC, num_warps=4)
                try:
                    row[name] = round(triton.testing.do_bench(launch, warmup=5, rep=50) * 1000, 1)
                except Exception as exc:  # noqa: BLE001 - one variant failing to build is reported
                    row[name] = f"{type(exc).__name__}: {str(exc)[:160]}"
            report[shape] = row
            print(shape, json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
