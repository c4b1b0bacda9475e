"""Synthetic checkpoints: layout, determinism, loading in Transformers; and the model-folder checks."""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import pathlib
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fastqwen import synth
from fastqwen.checkpoint import check_tensors, expected_tensors, read_config, read_safetensors_header, weight_files
from fastqwen.errors import UserError
from fastqwen.presets import get_generation_config, get_preset


def _digests(folder: pathlib.Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _load_hf(folder: pathlib.Path):
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(
        folder, torch_dtype=torch.bfloat16, attn_implementation="sdpa", output_loading_info=True
    )


# --- synthesis ---------------------------------------------------------------------------------

def test_tiny_loads_in_transformers_with_no_missing_or_unexpected_keys(tiny_model: pathlib.Path):
    model, info = _load_hf(tiny_model)
    assert info["missing_keys"] == [] and info["unexpected_keys"] == []
    assert info["mismatched_keys"] == [] and info["error_msgs"] == []
    # The loaded weights are the file's, not a fresh init: compare one tensor.
    on_disk = load_file(str(weight_files(tiny_model)[0]))
    assert torch.equal(model.model.layers[2].mlp.down_proj.weight, on_disk["model.layers.2.mlp.down_proj.weight"])


def test_tiny_folder_layout(tiny_model: pathlib.Path):
    names = sorted(p.name for p in tiny_model.iterdir())
    assert names == [
        "config.json", "generation_config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json",
    ]
    assert json.loads((tiny_model / "config.json").read_text()) == get_preset("tiny")
    assert json.loads((tiny_model / "generation_config.json").read_text()) == get_generation_config("tiny")
    with safe_open(str(tiny_model / "model-00001-of-00001.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert all(f.get_slice(k).get_dtype() == "BF16" for k in f.keys())
    assert "lm_head.weight" not in check_tensors(tiny_model)  # tied: Hugging Face omits it


def test_weights_finite_and_forward_free_of_inf_nan(tiny_model: pathlib.Path):
    model, _ = _load_hf(tiny_model)
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
    ids = torch.randint(0, 4096, (2, 300), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        logits = model(input_ids=ids).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def test_norm_weights_follow_the_init_scheme(tiny_model: pathlib.Path):
    scheme = synth.init_scheme(get_preset("tiny"))
    t = load_file(str(weight_files(tiny_model)[0]))
    final = t["model.norm.weight"].float()
    assert final.mean().item() == pytest.approx(scheme.final_norm_scale, rel=0.05)
    # Jittered, not constant: a kernel that skips a norm weight must change the result.
    assert t["model.layers.0.input_layernorm.weight"].float().std() > 0.05
    # Sharp attention in the first layers only, soft after.
    assert 1 <= scheme.stem_layers < 4 and scheme.stem_qk_norm_scale > scheme.qk_norm_scale
    for i in range(4):
        want = scheme.stem_qk_norm_scale if i < scheme.stem_layers else scheme.qk_norm_scale
        for kind in ("q_norm", "k_norm"):
            got = t[f"model.layers.{i}.self_attn.{kind}.weight"].float().mean().item()
            assert got == pytest.approx(want, rel=0.05), (i, kind)
    assert t["model.embed_tokens.weight"].float().std().item() == pytest.approx(scheme.embedding_std, rel=0.03)
    assert t["model.layers.1.mlp.up_proj.weight"].float().std().item() == pytest.approx(scheme.matrix_std, rel=0.02)


def test_vocabulary_row_norms_spread_log_normally(tiny_model: pathlib.Path):
    scheme = synth.init_scheme(get_preset("tiny"))
    emb = load_file(str(weight_files(tiny_model)[0]))["model.embed_tokens.weight"].float()
    log_norms = emb.norm(dim=-1).log()
    # log of a row's norm = log(c_v) + (nearly constant chi term): its spread is sigma's.
    assert log_norms.std().item() == pytest.approx(scheme.vocab_row_norm_sigma, rel=0.15)
    plain = synth.make_tensor("model.embed_tokens.weight", (4096, 128), synth.plain_init(get_preset("tiny")), 0, "cpu")
    assert plain.float().norm(dim=-1).log().std().item() < 0.1


def test_keys_share_a_component_with_the_first_query_head_of_their_group(tiny_model: pathlib.Path):
    cfg = get_preset("tiny")  # 4 query heads, 2 KV heads of dim 64: groups of 2
    scheme = synth.init_scheme(cfg)
    t = load_file(str(weight_files(tiny_model)[0]))
    q = t["model.layers.1.self_attn.q_proj.weight"].float().view(4, 64, 128)
    k = t["model.layers.1.self_attn.k_proj.weight"].float().view(2, 64, 128)

    def corr(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a * b).sum() / (a.norm() * b.norm()))

    for j in range(2):
        assert corr(k[j], q[2 * j]) == pytest.approx(scheme.key_query_correlation, abs=0.03)
        assert abs(corr(k[j], q[2 * j + 1])) < 0.03  # the group's other query head stays independent
    assert abs(corr(t["model.layers.1.self_attn.v_proj.weight"].float(), k.reshape(128, 128))) < 0.03


def test_median_top_gap_matches_the_gaussian_estimate_and_shrinks_with_spread():
    import math

    for vocab in (4096, 151936):
        classic = math.log(2) / math.sqrt(2 * math.log(vocab))
        assert synth.median_top_gap(vocab, 0.0) == pytest.approx(classic, rel=0.2)
        assert synth.median_top_gap(vocab, 0.25) > 1.5 * synth.median_top_gap(vocab, 0.0)
    assert synth.median_top_gap(4096, 0.25) == synth.median_top_gap(4096, 0.25)  # fixed seed


def test_same_seed_same_bytes_other_seed_differs(tmp_path: pathlib.Path, tiny_model: pathlib.Path):
    a = synth.synthesize("tiny", tmp_path / "a", seed=0, progress=False)
    b = synth.synthesize("tiny", tmp_path / "b", seed=7, progress=False)
    assert _digests(a) == _digests(tiny_model)
    da, db = _digests(a), _digests(b)
    assert da["config.json"] == db["config.json"]
    assert da["model-00001-of-00001.safetensors"] != db["model-00001-of-00001.safetensors"]


def test_tensor_values_do_not_depend_on_generation_order(tiny_model: pathlib.Path):
    scheme = synth.init_scheme(get_preset("tiny"))
    on_disk = load_file(str(weight_files(tiny_model)[0]))
    specs = expected_tensors(get_preset("tiny"))
    # Drawn alone and in reverse order, each tensor comes out as in the file
    # (a k_proj, which derives from its layer's q_proj, and the embedding included).
    chosen = specs[-6:] + [s for s in specs if s[0] in ("model.layers.2.self_attn.k_proj.weight", "model.embed_tokens.weight")]
    for name, shape in reversed(chosen):
        assert torch.equal(synth.make_tensor(name, shape, scheme, 0, "cpu"), on_disk[name]), name
    assert synth.tensor_seed(0, "a") != synth.tensor_seed(1, "a") != synth.tensor_seed(0, "b")


def test_shards_and_index_are_consistent(tmp_path: pathlib.Path, tiny_model: pathlib.Path):
    cap = 400_000  # bytes: forces several shards of the 3 MB tiny model
    out = synth.synthesize("tiny", tmp_path / "sharded", progress=False, max_shard_bytes=cap)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(shards)
    assert n > 2
    assert shards == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    total = 0
    seen: dict[str, str] = {}
    for shard in shards:
        header = read_safetensors_header(out / shard)
        sizes = [math.prod(e["shape"]) * 2 for e in header.values()]
        assert sum(sizes) <= cap or len(sizes) == 1
        total += sum(sizes)
        seen.update({name: shard for name in header})
    assert index["weight_map"] == seen
    assert index["metadata"]["total_size"] == total
    # Same values as the single-shard folder: sharding changes the layout only.
    single = load_file(str(weight_files(tiny_model)[0]))
    for shard in shards:
        for name, t in load_file(str(out / shard)).items():
            assert torch.equal(t, single[name])
    _, info = _load_hf(out)
    assert info["missing_keys"] == [] and info["unexpected_keys"] == []


def test_plan_shards_packs_in_order_and_isolates_big_tensors():
    specs = [("a", (10,)), ("b", (10,)), ("c", (100,)), ("d", (5,))]
    plan = synth.plan_shards(specs, max_bytes=40)
    assert [[n for n, _ in shard] for shard in plan] == [["a", "b"], ["c"], ["d"]]


def test_untied_config_writes_lm_head_and_loads(tmp_path: pathlib.Path):
    cfg = get_preset("tiny") | {"tie_word_embeddings": False}
    out = synth.synthesize("tiny", tmp_path / "untied", progress=False, config=cfg)
    assert "lm_head.weight" in check_tensors(out)
    model, info = _load_hf(out)
    assert info["missing_keys"] == [] and info["unexpected_keys"] == []
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_refuses_non_empty_folder_unless_forced(tmp_path: pathlib.Path):
    out = tmp_path / "m"
    synth.synthesize("tiny", out, progress=False, max_shard_bytes=1_000_000)
    assert len(list(out.glob("*.safetensors"))) > 1
    with pytest.raises(UserError, match="not empty"):
        synth.synthesize("tiny", out, progress=False)
    synth.synthesize("tiny", out, progress=False, force=True)
    # The stale shards of the earlier, sharded run are gone.
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model-00001-of-00001.safetensors"]
    check_tensors(out)


def test_refuses_a_file_as_output(tmp_path: pathlib.Path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(UserError, match="not a folder"):
        synth.synthesize("tiny", f, progress=False, force=True)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"preset": "qwen3-5b"}, "qwen3-5b"),
        ({"device": "tpu"}, "tpu"),
        ({"device": "cuda:x"}, "cuda:x"),
        ({"seed": -1}, "-1"),
    ],
)
def test_bad_input_names_the_value(tmp_path: pathlib.Path, kwargs: dict, needle: str):
    args = {"preset": "tiny", "out_dir": tmp_path / "m", "progress": False} | kwargs
    with pytest.raises(UserError, match=needle):
        synth.synthesize(**args)
    assert not (tmp_path / "m").exists()  # nothing written on bad input


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_requested_but_absent(tmp_path: pathlib.Path):
    with pytest.raises(UserError, match="'cuda'.*not available"):
        synth.synthesize("tiny", tmp_path / "m", device="cuda", progress=False)


def test_cli_run_writes_a_checkpoint(tmp_path: pathlib.Path, capsys):
    parser = argparse.ArgumentParser()
    synth.add_arguments(parser)
    args = parser.parse_args(["--preset", "tiny", "--out", str(tmp_path / "m"), "--seed", "3"])
    assert synth.run(args) == 0
    assert "synth:" in capsys.readouterr().err  # progress goes to stderr
    check_tensors(tmp_path / "m")
    with pytest.raises(UserError, match="--force"):
        synth.run(args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_generation_is_deterministic(tmp_path: pathlib.Path):
    a = synth.synthesize("tiny", tmp_path / "a", device="cuda", progress=False)
    b = synth.synthesize("tiny", tmp_path / "b", device="cuda", progress=False)
    assert _digests(a) == _digests(b)
    check_tensors(a)


# --- model-folder checks (fastqwen.checkpoint) -------------------------------------------------

@pytest.fixture()
def tiny_copy(tiny_model: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(shutil.copytree(tiny_model, tmp_path / "copy"))


def _edit_config(folder: pathlib.Path, **changes: object) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    for k, v in changes.items():
        if v is ...:
            cfg.pop(k)
        else:
            cfg[k] = v
    (folder / "config.json").write_text(json.dumps(cfg))


def test_read_config_accepts_tiny_and_fills_defaults(tiny_copy: pathlib.Path):
    assert read_config(tiny_copy)["head_dim"] == 64
    _edit_config(tiny_copy, head_dim=..., tie_word_embeddings=...)
    cfg = read_config(tiny_copy)
    assert cfg["head_dim"] == 128 // 4 and cfg["tie_word_embeddings"] is False


def test_read_config_missing_folder_and_file(tmp_path: pathlib.Path):
    with pytest.raises(UserError, match="does not exist"):
        read_config(tmp_path / "nope")
    with pytest.raises(UserError, match="config.json.*missing"):
        read_config(tmp_path)
    (tmp_path / "f").write_text("")
    with pytest.raises(UserError, match="not a folder"):
        read_config(tmp_path / "f")


def test_read_config_malformed_json(tiny_copy: pathlib.Path):
    (tiny_copy / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        read_config(tiny_copy)
    (tiny_copy / "config.json").write_text("[1, 2]")
    with pytest.raises(UserError, match="JSON object"):
        read_config(tiny_copy)


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"model_type": "llama"}, "model_type is 'llama'"),
        ({"hidden_size": ...}, "'hidden_size' is missing"),
        ({"vocab_size": "4096"}, "'vocab_size' must be a positive integer"),
        ({"num_hidden_layers": 0}, "'num_hidden_layers' must be a positive integer"),
        ({"rope_theta": -1}, "'rope_theta' must be a positive number"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
        ({"hidden_act": "gelu"}, "hidden_act is 'gelu'"),
        ({"head_dim": 0}, "'head_dim' must be a positive integer"),
    ],
)
def test_read_config_names_the_bad_field(tiny_copy: pathlib.Path, changes: dict, needle: str):
    _edit_config(tiny_copy, **changes)
    with pytest.raises(UserError, match=needle):
        read_config(tiny_copy)


def test_weight_files_index_single_and_missing(tiny_copy: pathlib.Path):
    assert [p.name for p in weight_files(tiny_copy)] == ["model-00001-of-00001.safetensors"]
    (tiny_copy / "model-00001-of-00001.safetensors").rename(tiny_copy / "model.safetensors")
    with pytest.raises(UserError, match="shard 'model-00001-of-00001.safetensors'.*missing"):
        weight_files(tiny_copy)
    (tiny_copy / "model.safetensors.index.json").unlink()
    assert [p.name for p in weight_files(tiny_copy)] == ["model.safetensors"]
    check_tensors(tiny_copy)  # a single-file folder is fine too
    (tiny_copy / "model.safetensors").unlink()
    with pytest.raises(UserError, match="no weights"):
        weight_files(tiny_copy)


def test_weight_files_rejects_a_path_in_the_index(tiny_copy: pathlib.Path):
    index_path = tiny_copy / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.norm.weight"] = "../elsewhere.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(UserError, match="invalid file name '../elsewhere.safetensors'"):
        weight_files(tiny_copy)


def _rewrite(folder: pathlib.Path, drop: str | None = None, add: dict | None = None) -> None:
    """Rewrite the tiny copy's one shard and its index without `drop` and with `add`."""
    shard = folder / "model-00001-of-00001.safetensors"
    tensors = load_file(str(shard))
    if drop:
        tensors.pop(drop)
    tensors.update(add or {})
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {k: shard.name for k in sorted(tensors)}
    index_path.write_text(json.dumps(index))


def test_check_tensors_missing_tensor(tiny_copy: pathlib.Path):
    _rewrite(tiny_copy, drop="model.layers.3.self_attn.k_norm.weight")
    with pytest.raises(UserError, match="'model.layers.3.self_attn.k_norm.weight' is missing"):
        check_tensors(tiny_copy)


def test_check_tensors_unexpected_tensor(tiny_copy: pathlib.Path):
    _rewrite(tiny_copy, add={"model.layers.0.self_attn.q_proj.bias": torch.zeros(256, dtype=torch.bfloat16)})
    with pytest.raises(UserError, match="unexpected tensor 'model.layers.0.self_attn.q_proj.bias'"):
        check_tensors(tiny_copy)


def test_check_tensors_mis_shaped_tensor(tiny_copy: pathlib.Path):
    _edit_config(tiny_copy, intermediate_size=512)
    with pytest.raises(UserError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape \[384, 128\]"):
        check_tensors(tiny_copy)


def test_check_tensors_index_disagrees_with_shard(tiny_copy: pathlib.Path):
    index_path = tiny_copy / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = "model-00001-of-00001.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(UserError, match="'model.layers.9.mlp.up_proj.weight' is listed in the index"):
        check_tensors(tiny_copy)


def test_check_tensors_tolerates_a_tied_lm_head_of_the_right_shape(tiny_copy: pathlib.Path):
    _rewrite(tiny_copy, add={"lm_head.weight": torch.zeros(4096, 128, dtype=torch.bfloat16)})
    assert "lm_head.weight" in check_tensors(tiny_copy)
    _rewrite(tiny_copy, add={"lm_head.weight": torch.zeros(4096, 64, dtype=torch.bfloat16)})
    with pytest.raises(UserError, match="'lm_head.weight' has shape"):
        check_tensors(tiny_copy)


def test_check_tensors_corrupt_header(tiny_copy: pathlib.Path):
    (tiny_copy / "model-00001-of-00001.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{bad}")
    with pytest.raises(UserError, match="malformed safetensors header"):
        check_tensors(tiny_copy)
