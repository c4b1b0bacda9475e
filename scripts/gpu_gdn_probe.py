"""Where the GDN prompt pass's kernels spend their time: each of the three kernels (solve,
state, output) timed whole and with one stage at a time taken out (its results then wrong;
only the time is read), at the 4B's head shapes, on the workspaces a real pass leaves. Each
variant is the kernel's own source with one stage replaced, compiled from a temporary module.
(Session 11's run 4 timed the solve this way, with the diagonal blocks' substitution on
[4, 16, 16] tiles as one more variant, before the kernel took it.) The output kernel's
variants edit its default bf16-pair products. --form picks the hand-over between the solve and
the state kernel whose variants are timed (gdn.PrefillPlan.form; default: the engine's plan's):
"uw" (u and w) or "merged" (the inverse merged from 16-blocks, the state kernel from P). The
whole batch goes in one launch of each kernel (the engine's calls take up to slice_tokens).

    python scripts/gpu_gdn_probe.py [--shapes 1x8192,4x2048,16x8192] [--kernels solve,state,out]
        [--form uw|merged] [--out PATH]

Needs a CUDA device. Writes {"form": form, kernel: {shape: {variant: us}}} to JSON.
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

_NO_SUBSTITUTION = ("    for i in range(1, 16):\n", "    for i in range(1, 1):\n")
_NO_BLOCK_PRODUCTS = ("        nt = _dot3(tl.where(same, 0.0, at), x, PREC)\n"
                      "        m_inv = tl.trans(_dot3(_dot3(x, eye + _dot3(nt, nt, PREC), PREC), eye - nt, PREC))",
                      "        m_inv = tl.trans(x + tl.where(same, 0.0, at))")
_NO_U_W = [("    u = _dot_f32_bf16(m_inv * beta[None, :], v, PREC)", "    u = tl.sum(m_inv, axis=1)[:, None] * v.to(tl.float32)"),
           ("    w = _dot_f32_bf16(m_inv * (beta * rk * tl.exp(gamma))[None, :], k, PREC)",
            "    w = tl.sum(m_inv, axis=1)[:, None] * k.to(tl.float32)")]
_NO_WS = [("        ws = _dot3(w0, s0, PREC)", "        ws = tl.zeros([C, BV], dtype=tl.float32) + tl.sum(w0) + tl.sum(s0)"),
          ("        ws += _dot3(w1, s1, PREC)", "        ws += tl.sum(w1)")]
_NO_UPDATE = [("        s0 = s0 * carry + _dot_exact_left(k0t, vs, PREC)",
               "        s0 = s0 * carry + tl.sum(vs) + tl.sum(k0t.to(tl.float32))"),
              ("        s1 = s1 * carry + _dot_exact_left(k1t, vs, PREC)",
               "        s1 = s1 * carry + tl.sum(vs) + tl.sum(k1t.to(tl.float32))")]
_NO_H_STORE = [("        tl.store(h_ptr + (hrow + d0)[:, None] * DV + dv[None, :], s0)          # S at the chunk's start\n"
                "        tl.store(h_ptr + (hrow + d1)[:, None] * DV + dv[None, :], s1)\n", "")]
_NO_VNEW_STORE = [("        tl.store(u_ptr + (base + r)[:, None] * DV + dv[None, :], v_new)\n", "")]
_WS_ONE_PASS = [("        ws = _dot3(w0, s0, PREC)", "        ws = _dot3(w0, s0, \"tf32\")"),
                ("        ws += _dot3(w1, s1, PREC)", "        ws += _dot3(w1, s1, \"tf32\")")]
_NO_QH = [("        qh = _dot_bf16_pair(q0, h0, True)\n        qh += _dot_bf16_pair(q1, h1, True)",
           "        qh = tl.zeros([C, BV], dtype=tl.float32) + tl.sum(q0f) + tl.sum(h0) + tl.sum(h1)")]
_NO_ATTN_V = [("        av = _dot_bf16_pair(attn, v_new, False)", "        av = tl.sum(attn) + v_new")]

# the merged form (PrefillPlan.form "merged"): the solve's merge products, the state kernel's
# k_raw S and P y
_NO_MERGE_PRODUCTS = [("-_dot3(_dot3(y00, a01, PREC), y11, PREC)", "-(y00 + a01 + y11)"),
                      ("-_dot3(_dot3(y22, a23, PREC), y33, PREC)", "-(y22 + a23 + y33)"),
                      ("-_dot3(_dot3(y_aa, a_ab, PREC), y_bb, PREC)", "-(y_aa + a_ab + y_bb)")]
_NO_KS = [("            ks = _dot_exact_left(k0, s0, PREC)\n            ks += _dot_exact_left(k1, s1, PREC)",
           "            ks = (tl.zeros([C, BV], dtype=tl.float32) + tl.sum(k0.to(tl.float32)) + tl.sum(k1.to(tl.float32))\n"
           "                  + tl.sum(s0) + tl.sum(s1))")]
_NO_PY = [("            v_new = _dot3(pm, y, PREC)", "            v_new = y + tl.sum(pm)")]

# kernel -> variant -> (old text, new text) pairs applied to the kernel's source, per form
MERGED_VARIANTS = {
    "solve": {
        "whole": [],
        "no_substitution": [_NO_SUBSTITUTION],
        "no_merge_products": _NO_MERGE_PRODUCTS,
        "only_loads_stores": [_NO_SUBSTITUTION] + _NO_MERGE_PRODUCTS,
    },
    "state": {
        "whole": [],
        "no_k_s": _NO_KS,
        "no_p_y": _NO_PY,
        "no_state_update": _NO_UPDATE,
        "only_loads_stores": _NO_KS + _NO_PY + _NO_UPDATE,
        "no_h_store": _NO_H_STORE,
        "no_vnew_store": _NO_VNEW_STORE,
    },
}
VARIANTS = {
    "solve": {
        "whole": [],
        "no_substitution": [_NO_SUBSTITUTION],
        "no_block_products": [_NO_BLOCK_PRODUCTS],
        "no_u_w": _NO_U_W,
        "only_loads_stores": [_NO_SUBSTITUTION, _NO_BLOCK_PRODUCTS] + _NO_U_W,
    },
    "state": {
        "whole": [],
        "no_w_s": _NO_WS,
        "no_state_update": _NO_UPDATE,
        "only_loads_stores": _NO_WS + _NO_UPDATE,
        "no_h_store": _NO_H_STORE,
        "no_vnew_store": _NO_VNEW_STORE,
        "ws_one_pass": _WS_ONE_PASS,
    },
    "out": {
        "whole": [],
        "no_q_s": _NO_QH,
        "no_attn_v": _NO_ATTN_V,
        "only_qk": _NO_QH + _NO_ATTN_V,
    },
}
MERGED_VARIANTS["out"] = VARIANTS["out"]
FORM_VARIANTS = {"uw": VARIANTS, "merged": MERGED_VARIANTS}
KERNELS = {"solve": "_chunk_solve_kernel", "state": "_chunk_state_kernel", "out": "_chunk_out_kernel"}


def variant_kernel(kernel: str, name: str, edits: list, tmp: str):
    src = inspect.getsource(getattr(gdn, KERNELS[kernel]).fn)
    src = src[src.index("def "):]                       # without its decorator
    for old, new in edits:
        if old not in src:
            raise RuntimeError(f"{kernel} variant {name}: {old[:60]!r} not in the kernel's source")
        src = src.replace(old, new)
    path = os.path.join(tmp, f"{kernel}_{name}.py")
    with open(path, "w") as f:
        f.write("import triton\nimport triton.language as tl\nfrom fqkernels.gdn import *\n"
                "from fqkernels.gdn import _dot3, _dot_f32_bf16, _dot_tf32_exact, _inv_norm, _tf32_head, "
                "_bf16_thirds, _bf16_pair, _dot_bf16_pair, _initial_halves, "
                "_dot_exact_left\n\n@triton.jit\n" + src)
    spec = importlib.util.spec_from_file_location(f"{kernel}_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, KERNELS[kernel])


def launches(B: int, T: int, q, k, v, g, beta, HK: int, HV: int, D: int, form: str):
    """Each kernel's launch as chunked_prefill makes it at the engine's plan (gdn.DEFAULT_PLAN: its
    products' forms, register caps and columns) in `form` ("uw" or "merged"), over workspaces a
    real pass fills (solve, then state, then out, once before any timing)."""
    dev, plan, C = v.device, gdn.DEFAULT_PLAN, gdn.CHUNK
    bv = plan.block_v or gdn._state_columns(B * HV, D, dev)
    nc = triton.cdiv(T, C)
    ws = B * HV * nc * C
    u = torch.empty((ws, D), dtype=torch.float32, device=dev)
    w = torch.empty((ws, C if form == "merged" else D), dtype=torch.float32, device=dev)     # w, or P
    solve_form = {} if form == "uw" else dict(p_ptr=w, INVERSE=True, MERGED=True)
    state_form = {} if form == "uw" else dict(p_ptr=w, v_ptr=v, stride_vb=v.stride(0), stride_vt=v.stride(1),
                                              stride_vh=v.stride(2), INVERSE=True)
    gamma, rk = (torch.empty((ws,), dtype=torch.float32, device=dev) for _ in range(2))
    h = torch.empty((ws // C * D, D), dtype=torch.float32, device=dev)
    state = torch.empty((B, HV, D, D), dtype=torch.float32, device=dev)
    out = torch.empty((B, T, HV, D), dtype=torch.bfloat16, device=dev)
    common = dict(HV=HV, RATIO=HV // HK, C=C, DK=D, DV=D)

    def solve(kern):
        kern[(B * HV, nc)](k, v, g, beta, u, w, gamma, rk, T, nc, k.stride(0), k.stride(1), k.stride(2),
                           v.stride(0), v.stride(1), v.stride(2), g.stride(0), g.stride(1),
                           num_warps=plan.solve_warps, PREC=plan.solve_form, **plan.caps("solve"),
                           **solve_form, **common)

    def state_(kern):
        kern[(D // bv, B * HV)](k, u, w, gamma, rk, h, state, T, nc, k.stride(0), k.stride(1),
                                k.stride(2), state.stride(0), BV=bv, num_warps=plan.state_warps,
                                num_stages=plan.state_stages, PREC=plan.prec, **plan.caps("state"),
                                **state_form, **common)

    def out_(kern):
        kern[(B * HV, nc, D // plan.out_bv)](q, k, u, gamma, rk, h, out, T, nc, D ** -0.5, q.stride(0), q.stride(1),
                                             q.stride(2), out.stride(0), out.stride(1), out.stride(2),
                                             BV=plan.out_bv, num_warps=plan.out_warps, PREC=plan.out_prec,
                                             **plan.caps("out"), **common)

    return {"solve": solve, "state": state_, "out": out_}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1x8192,4x2048,16x8192")
    ap.add_argument("--kernels", default="solve,state,out")
    ap.add_argument("--form", choices=tuple(FORM_VARIANTS), default=None,
                    help="the hand-over whose variants are timed (default: the engine's plan's; 'inverse' as 'merged')")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gdn_probe.json"))
    args = ap.parse_args()
    kernels = args.kernels.split(",")
    unknown = [k for k in kernels if k not in VARIANTS]
    if unknown:
        ap.error(f"--kernels: unknown {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    form = args.form or ("uw" if gdn.DEFAULT_PLAN.form == "uw" else "merged")
    variants = FORM_VARIANTS[form]
    from bench_gdn import HK, HV, D, _inputs

    dev = torch.device("cuda")
    report = {"form": form, **{kern: {} for kern in kernels}}
    with tempfile.TemporaryDirectory() as tmp:
        built = {kern: {name: variant_kernel(kern, name, edits, tmp) for name, edits in variants[kern].items()}
                 for kern in kernels}
        for shape in args.shapes.split(","):
            B, T = (int(x) for x in shape.split("x"))
            q, k, v, g, beta = _inputs(B, T, dev)
            run = launches(B, T, q, k, v, g, beta, HK, HV, D, form)
            for kern in ("solve", "state", "out"):          # the real pass, in order: every workspace filled
                run[kern](getattr(gdn, KERNELS[kern]))
            torch.cuda.synchronize()
            for kern in kernels:
                row = {}
                for name, variant in built[kern].items():
                    try:
                        row[name] = round(triton.testing.do_bench(lambda: run[kern](variant), warmup=5, rep=50) * 1000, 1)
                    except Exception as exc:  # noqa: BLE001 - one variant failing to build is reported
                        row[name] = f"{type(exc).__name__}: {str(exc)[:160]}"
                report[kern][shape] = row
                print(kern, shape, json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
