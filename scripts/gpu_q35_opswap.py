"""Qwen3.5: is fastqwen's engine further from Transformers' full forward than Transformers'
own cached decode is, and which piece of the engine moves the logits? On the same tokens:
native Transformers 5.17 (the judge's native engine: BF16, sdpa, TF32 and cuDNN attention
off) decodes greedily with its cache (its per-step logits: `native_cached`, the yardstick);
its full forward over prompt + those tokens, in the judge replay's row slices, is the
truth; each engine variant is teacher-forced on native's tokens (prefill, then one eager
decode step per token: the kernels of the engine's graphs, its cache capacity and its
GEMV/cuBLAS tuning for the batch) and its per-step logits are compared with the truth.

Variants: `engine` (as it runs); `engine_out_tf32x3` (the GDN prompt pass's output kernel
at out_prec "tf32x3" instead of the default "bf16x2"); `engine_state_bf16x2` (its state
kernel on bf16 pairs, the solve on bf16 thirds, PrefillPlan(prec="bf16x2", solve_prec="bf16x3",
block_v=16): a faster candidate's fidelity; the solve on pairs too lost repeated keys on an
H200, session 16); `engine_no_exact_decode` (the decode products
tuned without exact decode, as FASTQWEN_EXACT_DECODE=0: does the in-order GEMV at 7-32 rows
bring the engine nearer the full forward at Qwen3.5's shapes?); `engine_prefill_cublas_unpacked`
(the prompt pass's products on the reference's separate matrices, cuBLAS, lm_head
included; decode unchanged); `engine_cublas_unpacked` (every product so, prompt pass and
decode); `engine_gdn_step_torch` / `engine_attention_step_torch` (the decode step's GDN layers /
attention layers on the torch reference ops, products unchanged: gdn_step_torch,
attention_step_torch); `engine_decode_torch` (the last three together); `engine_prompt_torch`
(the prompt pass on the torch backend, its caches copied into the engine's, which decodes) and
`torch_prompt_engine` (the other way round): which half of the run makes the extra noise;
`engine_prompt_gdn_core_torch` (the prompt pass's chunked rule on the torch reference,
gdn.delta_rule_chunked_reference, everything else the engine's) and `engine_prompt_gdn_torch` (its
GDN layers' gates, conv, rule and gated norm all on the references): which of the prompt pass's
pieces; `torch_backend`
(Qwen35Model on the torch reference ops). Which of them brings the engine to native's figures
says where its extra noise is made. Two more run native's own full forward with its chunked
rule's first P positions (the prompt; P a multiple of 64) taken from another rule and the rest
from the reference's function from that rule's state (prompt_rule_in_full_forward):
`fullfwd_prompt_fast` (the engine's fast kernels, gdn.chunked_prefill, for the prompt): what an
engine with the fast prompt rule and a decode that gave the full forward's bits would show, the
fast rule's noise alone; `fullfwd_prompt_reference` (gdn.chunked_prefill_reference: the control,
which must give the full forward's logits exactly). `engine_gdn_decode_chunked`: the engine
with each GDN decode step in the full forward's arithmetic instead of the recurrent step's: the
step's in_proj and out_proj products the engine's, then the layer's conv, gates and chunked
rule over the current chunk's rows so far (from the conv and recurrent states at the chunk's
start, carried from chunk to chunk as the full forward carries them) on the prompt pass's
kernels and the reference's rule, its last row taken (chunked_gdn_decode; prompts a multiple
of 64): what an exact GDN decode would give with today's prompt pass and products;
`engine_exact_prompt_gdn_decode_chunked`: that with the prompt's rule on the reference too.
All but `engine`, `torch_backend`, `fullfwd_prompt_reference` and `engine_gdn_decode_chunked`
need the triton backend (a CUDA device): elsewhere they are skipped with a note.

Per variant and shape: mean / p99 / max over positions of the max |logit diff| over the
vocabulary, and its mean at the prompt pass's own position (first) and over the decode steps;
the prompt pass's time (eager, warm: once more after the steps); argmax agreement with the
full forward (and with native's tokens); how many positions would carry a slack above 0.75 (the full forward's max minus its logit of the
variant's argmax, the judge's figure); the worst such slack; seconds. Self-check: the
engine teacher-forced on its own greedy tokens (Engine.generate) must pick them again. With
several --seeds each shape runs once a seed (each its own prompts) and "totals" sums the counts
over them all.

Native runs with the process's default cuBLAS bf16 reduction flag (the judge's native and
replay processes never set it); the engine's variants with it off, as Engine sets it.

    python scripts/gpu_q35_opswap.py --model DIR --shapes 16x512x128,4x2048x32 [--variants a,b] [--seeds N,M]
        [--out FILE] [--no-self-check]
Needs Transformers 5.17.0: run as a script, it puts the reference's site (fastqwen/refenv.py:
.venv-qwen35, or FASTQWEN_QWEN35_SITE) first on sys.path where that holds Transformers; else
the first Transformers on the path must be 5.17.0.
"""
import argparse
import contextlib
import dataclasses
import functools
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "engine"))
sys.path.insert(0, REPO)

from fastqwen import refenv  # noqa: E402

# Run as a script: the reference's site first, before anything imports safetensors or
# tokenizers (5.17 needs its own); imported (a test), the importer's path is left alone.
if __name__ == "__main__" and (refenv.qwen35_site() / "transformers").is_dir():
    sys.path.insert(0, str(refenv.qwen35_site()))

import engine as fq_engine  # noqa: E402
import fq_qwen35  # noqa: E402
from fqkernels import gdn  # noqa: E402

# The probe's engine and variants take the recurrent GDN decode step unless FASTQWEN_GDN_EXACT_DECODE=1
# is set (stage q35-opswap-xdecode): its swaps are of that step's pieces (the engine's own default is
# exact decode since session 31).
fq_qwen35.EXACT_DECODE = os.environ.get("FASTQWEN_GDN_EXACT_DECODE") == "1"

from fastqwen.judge.fidelity import NOISE_SLACK as SLACK  # noqa: E402
from fastqwen.judge.prompts import PromptSource  # noqa: E402
from fastqwen.judge.replay import LOGIT_BUDGET_BYTES  # noqa: E402

VARIANTS = ("engine", "engine_out_tf32x3", "engine_state_bf16x2", "engine_prefill_cublas_unpacked",
            "engine_no_exact_decode", "engine_cublas_unpacked", "engine_gdn_step_torch", "engine_attention_step_torch",
            "engine_decode_torch", "engine_prompt_torch", "torch_prompt_engine", "engine_prompt_gdn_core_torch",
            "engine_prompt_gdn_torch", "torch_backend", "fullfwd_prompt_fast", "fullfwd_prompt_reference",
            "engine_gdn_decode_chunked", "engine_exact_prompt_gdn_decode_chunked")
CHUNKED_DECODE = ("engine_gdn_decode_chunked", "engine_exact_prompt_gdn_decode_chunked")   # prompts of whole chunks
TRITON_ONLY = ("fullfwd_prompt_fast", "engine_exact_prompt_gdn_decode_chunked", "engine_out_tf32x3",
               "engine_state_bf16x2", "engine_prefill_cublas_unpacked", "engine_no_exact_decode",
               "engine_cublas_unpacked", "engine_gdn_step_torch", "engine_attention_step_torch", "engine_decode_torch",
               "engine_prompt_torch", "torch_prompt_engine", "engine_prompt_gdn_core_torch", "engine_prompt_gdn_torch")
FULLFWD = {"fullfwd_prompt_fast": "chunked_prefill", "fullfwd_prompt_reference": "chunked_prefill_reference"}
SLACKS = (0.25, 0.5)      # beside SLACK: finer counts, for runs with few positions over 0.75
TORCH_MODEL = ("engine_prompt_torch", "torch_prompt_engine", "torch_backend")     # need the torch backend's model
# what the judge's processes run with (read before Engine() turns it off for the engine)
_BF16_REDUCTION = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction


def load_native(model_dir: str, dev: torch.device):
    """The judge's native model (Transformers 5.17.0)."""
    import transformers

    if transformers.__version__ != refenv.QWEN35_TRANSFORMERS:
        raise SystemExit(f"transformers {transformers.__version__} from {transformers.__file__}; this probe needs "
                         f"{refenv.QWEN35_TRANSFORMERS} (PYTHONPATH=.venv-qwen35 or FASTQWEN_QWEN35_SITE)")
    from fastqwen.native_engine.engine import load_model
    from fastqwen.numerics import pin_reference_numerics

    pin_reference_numerics()  # TF32 off, no cuDNN attention: the judge's native and replay
    return load_model(model_dir).to(dev).eval()


@contextlib.contextmanager
def native_numerics():
    """cuBLAS's bf16 reduction flag as a fresh process has it, for native's forwards."""
    saved = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = _BF16_REDUCTION
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = saved


def native_run(native, prompts, G):
    """Native's cached greedy decode as its engine runs it: tokens [B, G] and per-step logits
    [B, G, V] (bf16)."""
    B = prompts.shape[0]
    with torch.inference_mode(), native_numerics():
        out = native(input_ids=prompts, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1]
        del out
        cached = torch.empty((B, G, logits.shape[-1]), dtype=logits.dtype, device=prompts.device)
        toks = torch.empty((B, G), dtype=torch.int64, device=prompts.device)
        for t in range(G):
            if t:
                out = native(input_ids=toks[:, t - 1:t], past_key_values=cache, use_cache=True, logits_to_keep=1)
                cache, logits = out.past_key_values, out.logits[:, -1]
                del out
            cached[:, t], toks[:, t] = logits, logits.argmax(-1)
        del cache
    return toks, cached


def truth(native, prompts, toks):
    """The judge replay's figures: one full forward over prompt + all G tokens, logits_to_keep
    G + 1 (the last predicts nothing), in its row slices; float32 [B, G, V]."""
    ids = torch.cat([prompts, toks], 1)
    B, G, V = toks.shape[0], toks.shape[1], native.config.vocab_size
    rows = max(1, LOGIT_BUDGET_BYTES.get(prompts.device.type, 512 << 20) // ((G + 1) * V * 4 * 2))
    full = torch.empty((B, G, V), dtype=torch.float32, device=prompts.device)
    with torch.inference_mode(), native_numerics():
        for r0 in range(0, B, rows):
            sl = slice(r0, min(B, r0 + rows))
            full[sl] = native(input_ids=ids[sl], use_cache=False, logits_to_keep=G + 1).logits[:, :G].float()
    return full


@contextlib.contextmanager
def prompt_rule_in_full_forward(rule, P: int):
    """Transformers' chunked rule (modeling_qwen3_5.torch_chunk_gated_delta_rule, what its full
    forward calls) with the first P positions' outputs and the state after them from rule
    (gdn.chunked_prefill's contract: q, k, v, g, beta -> (out, final state)) and the rest from the
    reference's own function from that state; P a multiple of the chunk, so the rest's chunks are
    the full forward's own. Yields a list that counts the calls rule took. Restored after."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    orig = m.torch_chunk_gated_delta_rule
    calls = []

    def split(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, **kwargs):
        if initial_state is not None or query.shape[1] <= P or P % chunk_size or not use_qk_l2norm_in_kernel:
            raise RuntimeError(f"prompt_rule_in_full_forward: a full forward over more than the prompt ({P}, a "
                               f"multiple of {chunk_size}) with l2-normed q, k and no state, got T {query.shape[1]}")
        out, state = rule(query[:, :P], key[:, :P], value[:, :P], g[:, :P], beta[:, :P])
        calls.append(query.shape[0])
        rest, final = orig(query[:, P:], key[:, P:], value[:, P:], g=g[:, P:], beta=beta[:, P:],
                           chunk_size=chunk_size, initial_state=state, output_final_state=output_final_state,
                           use_qk_l2norm_in_kernel=True, **kwargs)
        return torch.cat([out.to(rest.dtype), rest], 1), final

    m.torch_chunk_gated_delta_rule = split
    try:
        yield calls
    finally:
        m.torch_chunk_gated_delta_rule = orig


def forced_logits(model, prompts, toks, prefill_patch=contextlib.nullcontext, prompt_model=None):
    """The model's logits [B, G, V] (bf16) teacher-forced on toks [B, G]: step 0 the prompt
    pass's (under prefill_patch()), step t the decode step fed toks[:, t - 1] at position
    P + t - 1 (int32 positions, lengths = positions + 1, on the device), with the cache the
    engine allocates for P + G - 1 positions (its rounded capacity: decode attention's split
    count follows it). prompt_model (another Qwen35Model): the prompt pass and step 0's
    logits are its, and its caches (every layer's keys, values, conv and recurrent states)
    are copied into model's before the decode steps."""
    (B, P), G = prompts.shape, toks.shape[1]
    with torch.inference_mode():
        cap = fq_engine._rounded_capacity(P + G - 1)
        model.ensure_rope(P + G - 1)
        model.allocate_cache(B, cap)
        with prefill_patch():
            if prompt_model is None:
                first = model.prefill_logits(prompts)
            else:
                prompt_model.ensure_rope(P + G - 1)
                prompt_model.allocate_cache(B, cap)
                first = prompt_model.prefill_logits(prompts)
                for name in ("k_cache", "v_cache", "conv_state", "state"):
                    getattr(model, name).copy_(getattr(prompt_model, name))
                prompt_model.allocate_cache(1, 2)
        out = torch.empty((B, G, first.shape[-1]), dtype=first.dtype, device=first.device)
        out[:, 0] = first
        pos = torch.full((B,), P, dtype=torch.int32, device=prompts.device)
        for t in range(1, G):
            out[:, t] = model.decode_logits(toks[:, t - 1].contiguous(), pos, pos + 1)
            pos += 1
    return out


@contextlib.contextmanager
def plan_patch(**fields):
    """gdn.chunked_prefill (as fq_qwen35 calls it) with those fields of the default plan replaced."""
    orig = gdn.chunked_prefill
    gdn.chunked_prefill = functools.partial(orig, plan=dataclasses.replace(gdn.DEFAULT_PLAN, **fields))
    try:
        yield
    finally:
        gdn.chunked_prefill = orig


@contextlib.contextmanager
def no_exact_decode(model, rows: int):
    """The whole run without exact decode (gemv.EXACT off, as FASTQWEN_EXACT_DECODE=0 would): the
    decode products tuned again at `rows` on their times alone, split-K configs allowed; gemv.EXACT
    and the products' choice restored after."""
    from fqkernels import gemv

    saved, saved_use = gemv.EXACT, dict(model.ops.use_gemv)
    gemv.EXACT = False
    try:
        model.ops.tune(model.w, rows)
        yield
    finally:
        gemv.EXACT = saved
        model.ops.use_gemv = saved_use


@contextlib.contextmanager
def unpacked_products(model):
    """The triton model's products (model.ops) as the reference's: each packed matrix (a GDN
    layer's qkv | z | b | a, an attention layer's q | k | v, gate | up) as its separate
    matrices' F.linear calls, concatenated; every other product F.linear (cuBLAS)."""
    c, w, ops = model.cfg, model.w, model.ops
    vd = c.linear_v_heads * c.linear_v_dim
    splits = {}
    for i, kind in enumerate(c.layer_types):
        if kind == "linear_attention":
            splits[w[f"model.layers.{i}.linear_attn.in_proj.weight"].data_ptr()] = \
                [c.conv_dim, vd, c.linear_v_heads, c.linear_v_heads]
        else:
            splits[w[f"model.layers.{i}.self_attn.qkv_proj.weight"].data_ptr()] = \
                [2 * c.num_heads * c.head_dim, c.kv_size, c.kv_size]

    def linear(x, wt):
        sizes = splits.get(wt.data_ptr())
        if sizes is None:
            return F.linear(x, wt)
        return torch.cat([F.linear(x, part) for part in torch.split(wt, sizes)], -1)

    def linear_silu_mul(x, wt):
        gate, up = wt.chunk(2)
        return F.silu(F.linear(x, gate)) * F.linear(x, up)

    ops.linear, ops.linear_silu_mul = linear, linear_silu_mul   # instance attributes over the class's
    try:
        yield
    finally:
        del ops.linear, ops.linear_silu_mul


def _causal_conv_prefill_torch(u, conv_w, conv_state=None, **_):
    out, state = gdn.causal_conv_reference(u.transpose(1, 2), conv_w, conv_state)
    return out.transpose(1, 2), state


def _gated_rmsnorm_torch(x, z, w, eps=gdn.EPS, **_):
    return gdn.gated_rmsnorm_reference(x, z.reshape(-1, x.shape[-1]), w, eps)


@contextlib.contextmanager
def gdn_prompt_torch(core_only: bool):
    """The prompt pass's GDN pieces on the torch references (module attributes of fqkernels.gdn,
    as fq_qwen35 calls them): the chunked rule only (core_only), or the gates, the conv, the rule
    and the gated norm; restored after. forced_logits applies it around the prompt pass only (the
    decode step also calls gdn.gated_rmsnorm)."""
    swap = {"chunked_prefill": gdn.chunked_prefill_reference}
    if not core_only:
        swap.update(gates=gdn.gates_reference, causal_conv_prefill=_causal_conv_prefill_torch,
                    gated_rmsnorm=_gated_rmsnorm_torch)
    saved = {name: getattr(gdn, name) for name in swap}
    for name, fn in swap.items():
        setattr(gdn, name, fn)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(gdn, name, fn)


def gdn_step_torch(model, i: int, h: torch.Tensor, positions=None) -> torch.Tensor:
    """One decode step of GDN layer i on the torch reference ops (what the torch backend's
    Qwen35Model._gdn runs for a step: conv and gates, the recurrent rule with heads repeated, the
    gated norm), its products the model's own (model._in_proj, model.ops): h [B, 1, hidden] ->
    [B, 1, hidden], the layer's conv and recurrent states updated in place."""
    c, p = model.cfg, f"model.layers.{i}.linear_attn."
    B, slot = h.shape[0], model.gdn_slot[i]
    mixed, z, b, a = model._in_proj(p, h[:, 0])
    mixed, g, beta = gdn.conv_gates_step_reference(mixed, model.conv_state[slot, :B],
                                                   model.w[p + "conv1d.weight"].squeeze(1), a, b,
                                                   model.w[p + "A_log"], model.w[p + "dt_bias"])
    kd = c.linear_k_heads * c.linear_k_dim
    q, k, v = torch.split(mixed, [kd, kd, c.linear_v_heads * c.linear_v_dim], dim=-1)
    q, k, v = q.reshape(B, -1, c.linear_k_dim), k.reshape(B, -1, c.linear_k_dim), v.reshape(B, -1, c.linear_v_dim)
    o = gdn.decode_step_reference(q, k, v, g, beta, model.state[slot, :B])
    o = gdn.gated_rmsnorm_reference(o.reshape(-1, c.linear_v_dim), z.reshape(-1, c.linear_v_dim),
                                    model.w[p + "norm.weight"], c.rms_norm_eps)
    return model.ops.linear(o.reshape(B, 1, -1), model.w[p + "out_proj.weight"])


def attention_step_torch(model, i: int, h: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor):
    """One decode step of attention layer i on the torch reference ops (the torch backend's
    Qwen35Model._attention_step in the row form: the (1 + w) norms, the partial RoPE, the key and
    value written at the positions, SDPA over the cached prefix), its products the model's own
    (model._qkv_proj, model._attention_out): h [B, 1, hidden] -> [B, 1, hidden]."""
    if model.block_table is not None:
        raise ValueError("attention_step_torch: the row form only (the probe allocates rows)")
    c, p = model.cfg, f"model.layers.{i}.self_attn."
    B, slot = h.shape[0], model.attn_slot[i]
    cos, sin = (t[positions.long()].unsqueeze(1).unsqueeze(1) for t in (model.cos, model.sin))  # [B, 1, 1, r]
    qp, k, v = model._qkv_proj(p, h)
    q, gate = torch.chunk(qp.view(B, 1, -1, 2 * c.head_dim), 2, dim=-1)
    q = fq_qwen35._norm(q, model.w[p + "q_norm.weight"], c.rms_norm_eps).transpose(1, 2)
    k = fq_qwen35._norm(k.view(B, 1, -1, c.head_dim), model.w[p + "k_norm.weight"], c.rms_norm_eps).transpose(1, 2)
    q, k = fq_qwen35._rotate(q, cos, sin), fq_qwen35._rotate(k, cos, sin)
    v = v.view(B, 1, -1, c.head_dim).transpose(1, 2)
    kc, vc = model.k_cache[slot, :B], model.v_cache[slot, :B]
    rows = torch.arange(B, device=h.device)
    kc[rows, :, positions.long()] = k[:, :, 0]
    vc[rows, :, positions.long()] = v[:, :, 0]
    attn = fq_qwen35.sdpa_over_prefix(q, kc, vc, lengths, model.scale)
    return model._attention_out(i, attn.transpose(1, 2), gate)


def gdn_step_chunked(model, i: int, h: torch.Tensor, chunk: dict) -> torch.Tensor:
    """One decode step of GDN layer i in the full forward's arithmetic: in_proj on the token (the
    model's decode product), its rows appended to the current chunk's (chunk: this layer's rows
    and the conv and recurrent states at the chunk's start), then the conv, the gates and the
    chunked rule (delta_rule_chunked_reference: the chunk padded to 64 as the full forward pads
    its last) over the chunk's rows so far from those states, on the prompt pass's kernels
    (the torch references on the torch backend), its last row through the gated norm and the
    model's out_proj product: h [B, 1, hidden] -> [B, 1, hidden]. After the chunk's 64th row
    its end states start the next chunk. The model's own caches are not written."""
    c, p = model.cfg, f"model.layers.{i}.linear_attn."
    B = h.shape[0]
    if chunk.get("n") == gdn.CHUNK:
        chunk.update(n=0, conv0=chunk["conv_end"], state0=chunk["state_end"], rows=[])
    mixed, z, b, a = model._in_proj(p, h[:, 0])
    chunk["rows"].append(torch.cat([mixed, b, a], -1))
    chunk["n"] += 1
    rows = torch.stack(chunk["rows"], 1)                                            # [B, n, conv_dim + 2 Hv]
    mixed, b, a = torch.split(rows, [c.conv_dim, c.linear_v_heads, c.linear_v_heads], dim=-1)
    conv_w = model.w[p + "conv1d.weight"].squeeze(1)
    if model.backend == "triton":
        g, beta = gdn.gates(a, b, model.w[p + "A_log"], model.w[p + "dt_bias"])
        x, conv_end = gdn.causal_conv_prefill(mixed, conv_w, conv_state=chunk["conv0"].clone())
    else:
        g, beta = gdn.gates_reference(a, b, model.w[p + "A_log"], model.w[p + "dt_bias"])
        x, conv_end = gdn.causal_conv_reference(mixed.transpose(1, 2), conv_w, chunk["conv0"].clone())
        x = x.transpose(1, 2)
    kd, n = c.linear_k_heads * c.linear_k_dim, chunk["n"]
    q, k, v = torch.split(x, [kd, kd, c.linear_v_heads * c.linear_v_dim], dim=-1)
    q, k = q.reshape(B, n, -1, c.linear_k_dim), k.reshape(B, n, -1, c.linear_k_dim)
    v = v.reshape(B, n, -1, c.linear_v_dim)
    state_end = torch.empty_like(chunk["state0"])
    o, _ = gdn.chunked_prefill_reference(q, k, v, g, beta, state_out=state_end, initial_state=chunk["state0"])
    if n == gdn.CHUNK:
        chunk["conv_end"], chunk["state_end"] = conv_end, state_end
    o = o[:, -1].contiguous()                                                       # [B, Hv, Dv]
    if model.backend == "triton" and c.linear_v_dim == 128:
        o = gdn.gated_rmsnorm(o.reshape(-1, 128), z, model.w[p + "norm.weight"], c.rms_norm_eps)
    else:
        o = gdn.gated_rmsnorm_reference(o.reshape(-1, c.linear_v_dim), z.reshape(-1, c.linear_v_dim),
                                        model.w[p + "norm.weight"], c.rms_norm_eps)
    return model.ops.linear(o.reshape(B, 1, -1), model.w[p + "out_proj.weight"])


@contextlib.contextmanager
def chunked_gdn_decode(model):
    """The model's GDN decode steps as gdn_step_chunked (its prompt passes unchanged): each layer's
    first step takes the conv and recurrent states the prompt pass left as its chunk's start (the
    prompt a multiple of 64 positions: the first generated position starts a chunk)."""
    orig, chunks = model._gdn, {}

    def layer(i, h, prompt_rows, start=0, positions=None):
        if prompt_rows is not None:
            return orig(i, h, prompt_rows, start, positions)
        if i not in chunks:
            slot, B = model.gdn_slot[i], h.shape[0]
            chunks[i] = {"n": 0, "rows": [], "conv0": model.conv_state[slot, :B].clone(),
                         "state0": model.state[slot, :B].clone()}
        return gdn_step_chunked(model, i, h, chunks[i])

    model._gdn = layer
    try:
        yield chunks
    finally:
        model.__dict__.pop("_gdn", None)


@contextlib.contextmanager
def torch_steps(model, gdn_step: bool, attention_step: bool):
    """The model's decode steps with its GDN layers' step (gdn_step) and / or its attention
    layers' step (attention_step) on the torch reference ops (gdn_step_torch,
    attention_step_torch), everything else as it runs; the model's own methods back after."""
    if gdn_step:
        model._gdn_step_kernels = functools.partial(gdn_step_torch, model)
    if attention_step:
        model._attention_step = lambda i, h, cos, sin, positions, lengths: attention_step_torch(
            model, i, h, positions, lengths)
    try:
        yield
    finally:
        for name in ("_gdn_step_kernels", "_attention_step"):
            model.__dict__.pop(name, None)


def compare(steps, full, toks):
    """steps [B, G, V] (any float dtype), full [B, G, V] float32 -> the figures (module doc)."""
    d, slack, agree, agree_tok = [], [], [], []
    for b in range(full.shape[0]):     # a row at a time: no [B, G, V] temporaries
        s, f = steps[b].float(), full[b]
        d.append((s - f).abs().amax(-1))
        am = s.argmax(-1)
        slack.append(f.amax(-1) - f.gather(-1, am[:, None])[:, 0])
        agree.append(am == f.argmax(-1))
        agree_tok.append(am == toks[b])
    d2 = torch.stack(d).cpu()                                       # [B, G]
    d, slack, agree, agree_tok = (torch.stack(x).flatten().cpu() for x in (d, slack, agree, agree_tok))
    return {"positions": d.numel(), "mean_max_abs": float(d.mean()), "first_mean_max_abs": float(d2[:, 0].mean()),
            "decode_mean_max_abs": float(d2[:, 1:].mean()) if d2.shape[1] > 1 else None,
            "p99_max_abs": float(torch.quantile(d, 0.99)),
            "max_abs": float(d.max()), "argmax_agree": int(agree.sum()), "argmax_agree_fraction": float(agree.float().mean()),
            f"count_slack_gt_{SLACK}": int((slack > SLACK).sum()), "max_slack": float(slack.max()),
            **{f"count_slack_gt_{t}": int((slack > t).sum()) for t in SLACKS}, "mean_slack": float(slack.mean()),
            "native_token_agree": int(agree_tok.sum())}


@contextlib.contextmanager
def _decode_torch(model):
    """Every product the reference's separate matrices on cuBLAS and both decode steps on the
    torch reference ops: the engine's decode as near native's cached decode as its kernels of
    the layers' norms and adds, its prompt pass and its cache allow."""
    with unpacked_products(model), torch_steps(model, True, True):
        yield


def decode_choice(model, rows: int) -> dict:
    """matrix -> "gemv" / "cublas": what the engine's tuning chose for its decode products."""
    use_gemv = getattr(model.ops, "use_gemv", None)
    if use_gemv is None:       # the torch backend: cuBLAS throughout
        return {}
    out = {}
    for suffix, fused in fq_qwen35._DECODE_PRODUCTS.items():
        w = next((t for n, t in model.w.items() if n.endswith(suffix)), None)
        if w is not None:
            out[suffix.rsplit(".", 1)[0]] = "gemv" if use_gemv.get((fused, rows) + tuple(w.shape)) else "cublas"
    return out


def self_check(eng, prompts, G) -> dict:
    """Engine.generate's greedy tokens (its graphs on a GPU), then the eager teacher-forced
    steps on them: their argmax must be those tokens."""
    eng._drop_graphs()     # graphs of an earlier call point at caches forced_logits replaced
    greedy = torch.tensor(list(eng.generate(prompts.tolist(), G)), device=prompts.device).T.contiguous()
    eng._drop_graphs()
    forced = forced_logits(eng.model, prompts, greedy)
    agree = int((torch.stack([forced[b].argmax(-1) for b in range(forced.shape[0])]) == greedy).sum())
    return {"positions": greedy.numel(), "agree": agree}


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--shapes", default="16x512x128", help="comma-separated BxPxG")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--seed", type=int, default=5, help="the prompt source's seed (fastqwen/judge/prompts.py)")
    ap.add_argument("--seeds", default=None, help="comma-separated seeds: each shape once a seed (over --seed)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-self-check", action="store_true")
    args = ap.parse_args(argv)
    names = [n for n in args.variants.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    if fq_engine._model_type(args.model) not in fq_qwen35.MODEL_TYPES:
        raise SystemExit(f"{args.model} is not a Qwen3.5 checkpoint (scripts/gpu_opswap.py is the Qwen3 probe)")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")     # as Engine picks it
    native = load_native(args.model, dev)
    eng = fq_engine.Engine(args.model)      # TF32 off, bf16 reduction off, its backend, packed weights
    cfg = eng.cfg
    seeds = [int(v) for v in args.seeds.split(",")] if args.seeds else [args.seed]
    models = {}                             # the torch backend's model, loaded once when asked for
    report = {"model": args.model, "seeds": seeds, "device": str(dev), "engine": eng.describe(),
              "prompts": PromptSource.for_model(args.model, cfg.vocab_size, seeds[0]).kind, "shapes": {},
              "totals": {}}
    runs = [(shape, seed) for shape in args.shapes.split(",") for seed in seeds]
    for shape, seed in runs:
        B, P, G = (int(v) for v in shape.split("x"))
        t0 = time.perf_counter()
        source = PromptSource.for_model(args.model, cfg.vocab_size, seed)
        prompts = torch.tensor(source.draw(B, P), dtype=torch.int64, device=dev)
        toks, cached = native_run(native, prompts, G)
        _sync(dev)
        t_native = time.perf_counter() - t0
        full = truth(native, prompts, toks)
        _sync(dev)
        entry = {"native_seconds": round(t_native, 2), "truth_seconds": round(time.perf_counter() - t0 - t_native, 2),
                 "results": {"native_cached": compare(cached, full, toks)}, "skipped": {}}
        entry["results"]["native_cached"]["seconds"] = entry["native_seconds"]
        del cached
        with torch.inference_mode():
            eng.model.ensure_rope(P + G - 1)
            eng._tune(B)                    # the decode products' GEMV / cuBLAS choice at B rows, as warmup does
        entry["tuning_us"], entry["choice"] = eng.tuning.get(B, {}), decode_choice(eng.model, B)
        for name in names:
            if name in TRITON_ONLY and eng.model.backend != "triton":
                entry["skipped"][name] = f"needs the triton backend (the engine runs {eng.model.backend} here)"
                continue
            if name in CHUNKED_DECODE and P % gdn.CHUNK:
                entry["skipped"][name] = f"needs a prompt of a multiple of {gdn.CHUNK} positions, got {P}"
                continue
            if name in FULLFWD:
                if P % gdn.CHUNK:
                    entry["skipped"][name] = f"needs a prompt of a multiple of {gdn.CHUNK} positions, got {P}"
                    continue
                t1 = time.perf_counter()
                with prompt_rule_in_full_forward(getattr(gdn, FULLFWD[name]), P) as calls:
                    steps = truth(native, prompts, toks)
                _sync(dev)
                entry["results"][name] = {**compare(steps, full, toks), "seconds": round(time.perf_counter() - t1, 2),
                                          "prompt_ms": None, "rule_rows": sum(calls)}   # rows x GDN layers
                del steps
                _sync(dev)
                continue
            if name in TORCH_MODEL and "torch" not in models:
                models["torch"] = fq_qwen35.Qwen35Model(cfg, fq_qwen35.load_weights(args.model, cfg, dev, pack=False),
                                                        dev, "torch")
            model = models["torch"] if name in ("torch_backend", "torch_prompt_engine") else eng.model
            prompt_model = {"engine_prompt_torch": models.get("torch"), "torch_prompt_engine": eng.model}.get(name)
            patch = {"engine_out_tf32x3": lambda: plan_patch(out_prec="tf32x3"),
                     "engine_state_bf16x2": lambda: plan_patch(prec="bf16x2", solve_prec="bf16x3", block_v=16),
                     "engine_prefill_cublas_unpacked": lambda: unpacked_products(eng.model),
                     "engine_prompt_gdn_core_torch": lambda: gdn_prompt_torch(True),
                     "engine_exact_prompt_gdn_decode_chunked": lambda: gdn_prompt_torch(True),
                     "engine_prompt_gdn_torch": lambda: gdn_prompt_torch(False)}.get(name)
            whole = {"engine_no_exact_decode": lambda: no_exact_decode(eng.model, B),
                     "engine_cublas_unpacked": lambda: unpacked_products(eng.model),
                     "engine_gdn_step_torch": lambda: torch_steps(eng.model, True, False),
                     "engine_attention_step_torch": lambda: torch_steps(eng.model, False, True),
                     "engine_decode_torch": lambda: _decode_torch(eng.model),
                     "engine_gdn_decode_chunked": lambda: chunked_gdn_decode(eng.model),
                     "engine_exact_prompt_gdn_decode_chunked": lambda: chunked_gdn_decode(eng.model)}.get(name)
            t1 = time.perf_counter()
            with (whole or contextlib.nullcontext)():
                steps = forced_logits(model, prompts, toks, patch or contextlib.nullcontext, prompt_model)
                _sync(dev)
                seconds = time.perf_counter() - t1
                prompt_ms = None
                if prompt_model is None:    # the prompt pass once more, eager and warm, timed
                    with (patch or contextlib.nullcontext)(), torch.inference_mode():
                        t2 = time.perf_counter()
                        model.prefill_logits(prompts)
                        _sync(dev)
                        prompt_ms = round(1e3 * (time.perf_counter() - t2), 2)
            entry["results"][name] = {**compare(steps, full, toks), "seconds": round(seconds, 2), "prompt_ms": prompt_ms}
            del steps
            model.allocate_cache(1, 2)      # the variant's caches go back
            _sync(dev)
        del full
        if not args.no_self_check:
            entry["self_check"] = self_check(eng, prompts, G)
            eng.model.allocate_cache(1, 2)
            _sync(dev)
        entry["seconds"] = round(time.perf_counter() - t0, 2)
        key = shape if len(seeds) == 1 else f"{shape}@{seed}"
        report["shapes"][key] = entry
        for name, r in entry["results"].items():
            t = report["totals"].setdefault(name, {"positions": 0, "sum_max_abs": 0.0, "sum_slack": 0.0,
                                                   "max_slack": 0.0})
            t["positions"] += r["positions"]
            t["sum_max_abs"] += r["mean_max_abs"] * r["positions"]
            t["sum_slack"] += r["mean_slack"] * r["positions"]
            t["max_slack"] = max(t["max_slack"], r["max_slack"])
            for k in [f"count_slack_gt_{v}" for v in (*SLACKS, SLACK)]:
                t[k] = t.get(k, 0) + r[k]
        sc = entry.get("self_check")
        print(f"== {key} ({entry['seconds']:.0f} s) decode products {entry['choice']}"
              + (f"; self-check {sc['agree']}/{sc['positions']}" if sc else ""), flush=True)
        print(f"{'variant':32s} {'mean|d|':>8s} {'first':>6s} {'p99|d|':>7s} {'max|d|':>7s} {'agree':>11s} {'>0.75':>6s} "
              f"{'maxslk':>7s} {'s':>6s} {'prompt ms':>9s}")
        for name, r in entry["results"].items():
            print(f"{name:32s} {r['mean_max_abs']:8.4f} {r['first_mean_max_abs']:6.3f} {r['p99_max_abs']:7.3f} {r['max_abs']:7.3f} "
                  f"{r['argmax_agree']:5d}/{r['positions']:<5d} {r[f'count_slack_gt_{SLACK}']:6d} "
                  f"{r['max_slack']:7.3f} {r['seconds']:6.1f} {r.get('prompt_ms') or float('nan'):9.2f}", flush=True)
        for name, why in entry["skipped"].items():
            print(f"{name:32s} skipped: {why}", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
    print(f"== totals over {len(runs)} run(s)\n{'variant':32s} {'positions':>9s} {'mean|d|':>8s} {'mean slk':>8s} "
          f"{'>0.25':>6s} {'>0.5':>6s} {'>0.75':>6s} {'maxslk':>7s}")
    for name, t in report["totals"].items():
        t["mean_max_abs"], t["mean_slack"] = t["sum_max_abs"] / t["positions"], t["sum_slack"] / t["positions"]
        print(f"{name:32s} {t['positions']:9d} {t['mean_max_abs']:8.4f} {t['mean_slack']:8.4f} "
              f"{t['count_slack_gt_0.25']:6d} {t['count_slack_gt_0.5']:6d} {t[f'count_slack_gt_{SLACK}']:6d} "
              f"{t['max_slack']:7.3f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
