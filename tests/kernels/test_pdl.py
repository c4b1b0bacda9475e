"""Programmatic dependent launch: the decode step's other kernels compile with the
wait/trigger instructions for sm_90 on the installed Triton (the platform's 3.1 in
CI), and PDL stays off where it cannot run."""
from __future__ import annotations

import sys

import pytest
import torch

from engine_modules import ENGINE_DIR

if str(ENGINE_DIR) not in sys.path:
    sys.path.insert(0, str(ENGINE_DIR))

from fqkernels import decode_attention, gemv, pdl, rmsnorm, rope_kv, swiglu  # noqa: E402

from .test_gemv import _aot_compile  # noqa: E402

needs_compiler = pytest.mark.skipif(gemv._INTERPRETED, reason="the interpreter does not compile")


def test_off_without_a_gpu_or_when_asked(monkeypatch):
    """PDL is on only where this Triton and GPU have it; set_enabled(False) (the engine's pdl=False,
    FASTQWEN_NO_PDL=1) turns it off, and on again only where available."""
    if not torch.cuda.is_available() or gemv._INTERPRETED:
        assert not pdl.ENABLED and pdl.LAUNCH == {} and not pdl.available()
    monkeypatch.setattr(pdl, "ENABLED", pdl.ENABLED)
    monkeypatch.setattr(pdl, "LAUNCH", pdl.LAUNCH)
    assert pdl.set_enabled(False) is False and pdl.LAUNCH == {} and pdl.for_rows(1) == (False, {})
    assert pdl.set_enabled(True) is pdl.available()
    assert (pdl.LAUNCH == {"launch_pdl": True}) is pdl.available()


def _assert_pdl(ptx: str) -> None:
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx


@needs_compiler
def test_attention_kernels_compile_with_pdl():
    sig = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "lengths_ptr": "*i32", "table_ptr": "*i32",
           "acc_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "out_ptr": "*bf16", "qk_scale": "fp32",
           "WINDOW": "i32", "stride_qb": "i32", "stride_qh": "i32", "stride_kb": "i32", "stride_kh": "i32", "stride_kn": "i32",
           "stride_vb": "i32", "stride_vh": "i32", "stride_vn": "i32", "stride_ob": "i32", "stride_oh": "i32",
           "stride_tb": "i32", "CAPACITY": "i32", "SPLIT_LEN": "i32", "NUM_SPLITS": "i32"}
    for paged, early in ((False, False), (True, False), (False, True)):   # the row cache, the paged one (pages
        # through a block table), the row cache with the reads before the wait (pdl.EARLY)
        consts = dict(KVH=8, G=4, D=128, BLOCK_N=64, BLOCK_G=16, DIRECT=False, FLASH_ORDER=True, PDL=True,
                      FA2_PATH=False, PAGED=paged, PAGE=64, PAGE_IDS=0, EARLY=early, PREFETCH=2 if early else 0)
        ptx = _aot_compile(decode_attention._split_kernel, sig, consts, ("q_ptr", "k_ptr", "v_ptr"), 4, 3).asm["ptx"]
        _assert_pdl(ptx)
        _assert_early(ptx, early, prefetches=early)
    sig = {"acc_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "lengths_ptr": "*i32", "out_ptr": "*bf16",
           "stride_ob": "i32", "stride_oh": "i32", "CAPACITY": "i32", "SPLIT_LEN": "i32", "NUM_SPLITS": "i32",
           "gate_ptr": "*bf16", "stride_gb": "i32", "stride_gh": "i32"}
    for gate, early in ((False, False), (True, False), (True, True)):    # the merge alone, and with Qwen3.5's
        # output gate in it, also with the length read before the wait
        consts = dict(H=32, SPLITS_P2=16, D=128, D_CHUNK=128, PDL=True, GATE=gate, INTERPRETED=False, EARLY=early)
        ptx = _aot_compile(decode_attention._combine_kernel, sig, consts, ("acc_ptr",), 4, 1).asm["ptx"]
        _assert_pdl(ptx)
        _assert_early(ptx, early)


def _assert_early(ptx: str, early: bool, prefetches: bool = False) -> None:
    """With early reads a global load (the length or position) comes before the wait, with
    `prefetches` the L2 prefetches too; without, no global load or prefetch does."""
    before = ptx[ptx.index(".entry"):ptx.index("griddepcontrol.wait")]
    assert ("ld.global" in before) == early
    assert ("prefetch.global.L2" in before) == prefetches


@needs_compiler
def test_norm_and_rope_kernels_compile_with_pdl():
    base = {"x_ptr": "*bf16", "r_ptr": "*fp32", "w_ptr": "*bf16", "out_ptr": "*bf16", "ids_ptr": "*i64",
            "table_ptr": "*bf16"}
    strides = {"stride_x": "i32", "stride_h": "i32", "stride_r": "i32", "stride_o": "i32", "stride_split": "i32",
               "stride_t": "i32"}
    for gather in (False, True):
        flags = dict(HAS_RESIDUAL=not gather, SPLITS=0 if gather else 2, BLOCK=4096, GATHER=gather, PDL=True,
                     ONE_PLUS=False, HEADS=1)
        sig = {**base, "N": "i32", "eps": "fp32", **strides}
        _assert_pdl(_aot_compile(rmsnorm._rmsnorm_kernel, sig, flags, ("x_ptr",), 4, 1).asm["ptx"])
        sig = {**base, "stats_ptr": "*fp32", "inv_n": "fp32", "eps": "fp32", **strides}
        consts = dict(flags, N=2560, VEC=True, HALVES=True, STATS=False)
        _assert_pdl(_aot_compile(rmsnorm._rmsnorm_torch_order_kernel, sig, consts, ("x_ptr",), 4, 1).asm["ptx"])
    # Qwen3.5's q heads, read in place from the packed q | k | v product's rows
    consts = dict(HAS_RESIDUAL=False, SPLITS=0, BLOCK=256, GATHER=False, PDL=True, ONE_PLUS=True, HEADS=16, N=256,
                  VEC=True, HALVES=True, STATS=False)
    _assert_pdl(_aot_compile(rmsnorm._rmsnorm_torch_order_kernel, sig, consts, ("x_ptr",), 4, 1).asm["ptx"])
    sig = {"qkv_ptr": "*bf16", "qn_ptr": "*bf16", "kn_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16",
           "pos_ptr": "*i32", "q_ptr": "*bf16", "kc_ptr": "*bf16", "vc_ptr": "*bf16", "seq_len": "i32", "eps": "fp32",
           "stride_qkv": "i32", "stride_qt": "i32", "stride_qh": "i32", "stride_kb": "i32", "stride_kh": "i32",
           "stride_ks": "i32", "stride_vb": "i32", "stride_vh": "i32", "stride_vs": "i32",
           "table_ptr": "*i32", "stride_tb": "i32"}
    loads_before = {}
    for paged, early in ((False, False), (True, False), (False, True)):   # the row cache, the paged one (pages
        # through a block table), the position and the tables' rows read before the wait (pdl.EARLY)
        consts = dict(H=32, KVH=8, D=128, PDL=True, PAGED=paged, PAGE=64, EARLY=early)
        ptx = _aot_compile(rope_kv._qk_norm_rope_store_kernel, sig, consts, ("qkv_ptr",), 1, 1).asm["ptx"]
        _assert_pdl(ptx)
        loads_before[paged, early] = ptx[ptx.index(".entry"):ptx.index("griddepcontrol.wait")].count("ld.global")
    # the norms' weights before the wait in every form; early, the position's and the tables' loads too
    assert loads_before[False, True] > loads_before[False, False] > 0


@needs_compiler
def test_the_output_gate_compiles_with_pdl():
    """Qwen3.5's sigmoid output gate (Qwen3.5-4B's head_dim 256), its division correctly rounded
    without flushing subnormal quotients (swiglu.sigmoid_f32)."""
    sig = {"x_ptr": "*bf16", "g_ptr": "*bf16", "out_ptr": "*bf16", "T": "i32", "H": "i32",
           **{f"stride_{t}{d}": "i32" for t in "xg" for d in "bth"}}
    consts = dict(D=256, BLOCK_D=256, INTERPRETED=False, PDL=True)
    ptx = _aot_compile(swiglu._sigmoid_gate_mul_kernel, sig, consts, ("x_ptr", "g_ptr", "out_ptr"), 1, 1).asm["ptx"]
    _assert_pdl(ptx)
    assert "div.rn.f32" in ptx and "div.rn.ftz" not in ptx


def test_pdl_only_for_decode_sized_launches(monkeypatch):
    monkeypatch.setattr(pdl, "ENABLED", True)
    monkeypatch.setattr(pdl, "LAUNCH", {"launch_pdl": True})
    assert pdl.for_rows(1) == (True, {"launch_pdl": True})
    assert pdl.for_rows(pdl.MAX_ROWS) == (True, {"launch_pdl": True})
    assert pdl.for_rows(pdl.MAX_ROWS + 1) == (False, {})  # a prefill
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.for_rows(1) == (False, {})


@needs_compiler
def test_the_small_kernels_trigger_the_next_after_their_wait():
    """pdl.start: the residual norms, the output gate and the gated norm wait for the kernel before,
    then let the next be scheduled (the other order was measured slower: docs/PERFORMANCE.md)."""
    from fqkernels import gdn_norm

    base = {"x_ptr": "*bf16", "r_ptr": "*fp32", "w_ptr": "*bf16", "out_ptr": "*bf16", "ids_ptr": "*i64",
            "table_ptr": "*bf16"}
    strides = {"stride_x": "i32", "stride_h": "i32", "stride_r": "i32", "stride_o": "i32", "stride_split": "i32",
               "stride_t": "i32"}
    gate_sig = {"x_ptr": "*bf16", "g_ptr": "*bf16", "out_ptr": "*bf16", "T": "i32", "H": "i32",
                **{f"stride_{t}{d}": "i32" for t in "xg" for d in "bth"}}
    flags = dict(HAS_RESIDUAL=True, SPLITS=2, BLOCK=4096, GATHER=False, PDL=True, ONE_PLUS=False, HEADS=1)
    sig = {**base, "stats_ptr": "*fp32", "inv_n": "fp32", "eps": "fp32", **strides}
    gated_sig = {"x_ptr": "*bf16", "z_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "R": "i32",
                 "inv_n": "fp32", "eps": "fp32", "z_heads": "i32", "stride_z": "i32"}
    ptxs = [_aot_compile(rmsnorm._rmsnorm_torch_order_kernel, sig, dict(flags, N=2560, VEC=True, HALVES=True,
                                                                        STATS=False), ("x_ptr",), 4, 1).asm["ptx"],
            _aot_compile(rmsnorm._rmsnorm_kernel, {**base, "N": "i32", "eps": "fp32", **strides}, flags,
                         ("x_ptr",), 4, 1).asm["ptx"],
            _aot_compile(swiglu._sigmoid_gate_mul_kernel, gate_sig, dict(D=256, BLOCK_D=256, INTERPRETED=False,
                                                                         PDL=True), ("x_ptr", "g_ptr", "out_ptr"),
                         1, 1).asm["ptx"],
            _aot_compile(gdn_norm._gated_rmsnorm_kernel, gated_sig, dict(D=128, ROWS=1, VEC=True, HALVES=True, PDL=True,
                                                                    INTERPRETED=False),
                         ("x_ptr", "z_ptr", "out_ptr"), 1, 1).asm["ptx"]]
    for ptx in ptxs:
        _assert_pdl(ptx)
        assert ptx.index("griddepcontrol.wait") < ptx.index("griddepcontrol.launch_dependents")


def test_early_reads_only_up_to_early_max_rows(monkeypatch):
    """pdl.early: a launch's own flag where given, else the module's EARLY at up to EARLY_MAX_ROWS rows
    (the early reads cost the Qwen3-4B's step at 4 and 16 rows: docs/PERFORMANCE.md)."""
    from fqkernels import pdl

    monkeypatch.setattr(pdl, "EARLY", True)
    monkeypatch.setattr(pdl, "EARLY_MAX_ROWS", 1)
    assert pdl.early(None, 1) and not pdl.early(None, 4) and not pdl.early(None, 16)
    assert pdl.early(True, 16) and not pdl.early(False, 1)
    monkeypatch.setattr(pdl, "EARLY", False)
    assert not pdl.early(None, 1)
