"""Synthetic Qwen3.5 checkpoints (fastqwen.synth35): the layout Transformers 5.17.0 writes
and loads, the init, determinism, and 5.17's own cached decode against its full forward
on the tiny preset (run in the Qwen3.5 reference environment, .venv-qwen35)."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from fastqwen import refenv, synth35
from fastqwen.checkpoint import expected_tensors, mtp_tensors, qwen35_layer_types
from fastqwen.errors import UserError


def test_4b_layout_has_the_models_parameter_count():
    """4,205,751,296: what a native Transformers model built from the released 4B config
    holds, tied embedding counted once."""
    specs = expected_tensors(synth35.get_preset("qwen3.5-4b"))
    assert sum(math.prod(s) for _, s in specs) == 4_205_751_296
    assert "lm_head.weight" not in dict(specs)
    kinds = synth35.get_preset("qwen3.5-4b")["layer_types"]
    assert kinds.count("full_attention") == 8 and kinds[3] == kinds[31] == "full_attention"
    assert kinds == qwen35_layer_types(32)
    # A config without layer_types gets the same default pattern, and so the same tensors.
    bare = {k: v for k, v in synth35.get_preset("qwen3.5-4b").items() if k != "layer_types"}
    assert expected_tensors(bare) == specs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return synth35.synthesize("qwen3.5-tiny", tmp_path_factory.mktemp("q35") / "tiny", seed=0, progress=False)


def _weights(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_tiny_init_and_determinism(tiny, tmp_path):
    w = _weights(tiny)
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["mtp_num_hidden_layers"] == 1 and mtp_tensors(cfg)
    assert set(w) == {n for n, _ in expected_tensors(cfg) + mtp_tensors(cfg)}
    assert all(t.dtype == torch.bfloat16 for t in w.values())
    a_log = w["model.layers.0.linear_attn.A_log"]
    assert torch.isfinite(a_log).all() and (a_log.float().exp() >= 0.0099).all() and (a_log.float().exp() <= 16.1).all()
    # the default (fastqwen) family: small embedding with spread row norms, final norm from the vocabulary
    cfg = synth35.get_preset("qwen3.5-tiny")
    scale = torch.tensor(synth35.fastqwen_final_norm_scale(cfg) - 1.0).bfloat16()
    assert (w["model.norm.weight"] == scale).all() and (w["model.layers.0.input_layernorm.weight"] == 0).all()
    assert (w["model.layers.3.self_attn.q_norm.weight"] == 1).all()
    emb = w["model.embed_tokens.weight"].float()
    assert abs(emb.std().item() - 0.005) < 0.0008 and emb.norm(dim=1).std() / emb.norm(dim=1).mean() > 0.15
    assert (w["model.layers.0.linear_attn.norm.weight"] == 1).all()
    assert abs(w["model.layers.3.self_attn.q_proj.weight"].float().std().item() - 0.02) < 0.002
    plain = _weights(synth35.synthesize("qwen3.5-tiny", tmp_path / "plain", seed=0, progress=False, init="transformers"))
    assert (plain["model.norm.weight"] == 6).all() and (plain["model.layers.3.self_attn.q_norm.weight"] == 0).all()
    assert abs(plain["model.embed_tokens.weight"].float().std().item() - 0.02) < 0.002
    assert torch.equal(plain["model.layers.0.mlp.up_proj.weight"], w["model.layers.0.mlp.up_proj.weight"])
    again = _weights(synth35.synthesize("qwen3.5-tiny", tmp_path / "again", seed=0, progress=False))
    other = _weights(synth35.synthesize("qwen3.5-tiny", tmp_path / "other", seed=1, progress=False))
    assert all(torch.equal(w[n], again[n]) for n in w)
    assert not torch.equal(w["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_bad_options_are_named(tmp_path):
    with pytest.raises(UserError, match="unknown Qwen3.5 preset"):
        synth35.synthesize("qwen3.5-9b", tmp_path / "x")
    with pytest.raises(UserError, match="final norm scale"):
        synth35.synthesize("qwen3.5-tiny", tmp_path / "y", final_norm_scale=-1.0)
    with pytest.raises(UserError, match="unknown init 'hf'"):
        synth35.synthesize("qwen3.5-tiny", tmp_path / "w", init="hf")
    run = subprocess.run([sys.executable, "-m", "fastqwen.cli", "synth", "--preset", "qwen3.5-tiny", "--out",
                          str(tmp_path / "z"), "--massive-activations"], capture_output=True, text=True)
    assert run.returncode != 0 and "--massive-activations is for the Qwen3 presets" in run.stderr


_CHECK = r"""
import json, sys, torch
from transformers import AutoModelForCausalLM
m, info = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16, output_loading_info=True)
g = torch.Generator().manual_seed(0)
ids = torch.randint(0, m.config.vocab_size, (2, 100), generator=g)
with torch.no_grad():
    out = m.generate(ids, max_new_tokens=16, do_sample=False, output_logits=True, return_dict_in_generate=True)
    steps = torch.stack(out.logits, 1).float()
    full = m(out.sequences).logits[:, 99:115].float()
top = full.topk(2, -1).values
print(json.dumps({"class": type(m).__name__, "loading": {k: sorted(map(str, v)) for k, v in info.items()},
                  "max_diff": (steps - full).abs().max().item(),
                  "median_top_gap": (top[..., 0] - top[..., 1]).median().item()}))
"""


def test_transformers_5_17_loads_it_and_its_cached_decode_is_stable(tiny):
    env = refenv.reference_env("qwen3_5_text")
    run = subprocess.run([sys.executable, "-c", _CHECK, str(tiny)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["class"] == "Qwen3_5ForCausalLM"
    assert all(not v for v in got["loading"].values()), got["loading"]
    # Measured 0.0625 (cached one-token steps vs one chunked forward over prompt + 16 tokens).
    assert got["max_diff"] <= 0.25, got
    assert got["median_top_gap"] > 0.5, got


@pytest.mark.parametrize("init,realistic", [("fastqwen", True), ("transformers", False)])
def test_the_default_family_has_a_trained_models_logit_statistics(tmp_path, init, realistic, synth_stats):
    """synth-stats (Transformers 5.17 in its environment) on the tiny preset: the fastqwen family
    meets every realism bound (gap spread, no echo, positions with top-1s of their own) and is
    stable; Transformers' init is stable but echoes its input (the reason for the default)."""
    ckpt = synth35.synthesize("qwen3.5-tiny", tmp_path / init, seed=1, progress=False, init=init)
    _, report = synth_stats(ckpt, tmp_path / "stats.json", 1024, 64)
    assert report["stability_problems"] == []
    if realistic:
        assert report["realism_problems"] == [], report["realism_problems"]
    else:
        assert any("echoes" in p for p in report["realism_problems"]), report["realism_problems"]
