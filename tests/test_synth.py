"""Synthetic checkpoints: layout, determinism, loading in Transformers; and the model-folder checks."""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import pathlib
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fastqwen import synth, synth_common
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
        "config.json", "fastqwen_synth.json", "generation_config.json", "model-00001-of-00001.safetensors",
        "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
    ]
    prov = synth_common.read_provenance(tiny_model)
    assert prov["init"]["name"] == "fastqwen" and prov["massive_activations"] is None
    assert (prov["preset"], prov["seed"], prov["device"], prov["sliding_window"]) == ("tiny", 0, "cpu", None)
    assert prov["init"]["final_norm_scale"] == synth.init_scheme(get_preset("tiny")).final_norm_scale
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
        assert synth_common.median_top_gap(vocab, 0.0) == pytest.approx(classic, rel=0.2)
        assert synth_common.median_top_gap(vocab, 0.25) > 1.5 * synth_common.median_top_gap(vocab, 0.0)
    first = synth_common.median_top_gap(4096, 0.25)
    synth_common.median_top_gap.cache_clear()          # computed again, not the cached value
    assert synth_common.median_top_gap(4096, 0.25) == first  # fixed seed


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
    seeds = {synth_common.tensor_seed(0, "a"), synth_common.tensor_seed(1, "a"), synth_common.tensor_seed(0, "b")}
    assert len(seeds) == 3 and synth_common.tensor_seed(0, "a") == synth_common.tensor_seed(0, "a")


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
    plan = synth_common.plan_shards(specs, max_bytes=40)
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
    # The first, sharded write's stale shards are gone.
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


# --- sliding window, init families, provenance ------------------------------------------------

def test_sliding_window_goes_into_config_json_and_nowhere_else(tmp_path: pathlib.Path, tiny_model: pathlib.Path):
    out = synth.synthesize("tiny", tmp_path / "w", progress=False, sliding_window=48)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg == get_preset("tiny") | {"sliding_window": 48}
    assert cfg["use_sliding_window"] is False  # 4.51.3 windows every layer by sliding_window alone
    assert synth_common.read_provenance(out)["sliding_window"] == 48
    # Same weights as the window-free folder: the window is a config field only.
    assert _digests(out)["model-00001-of-00001.safetensors"] == _digests(tiny_model)["model-00001-of-00001.safetensors"]
    model, _ = _load_hf(out)
    assert model.config.sliding_window == 48


@pytest.mark.parametrize("window", [0, -3, 2.5, "64", True])
def test_sliding_window_must_be_a_positive_int(tmp_path: pathlib.Path, window: object):
    with pytest.raises(UserError, match=f"sliding window must be a positive integer.*got {re.escape(repr(window))}"):
        synth.synthesize("tiny", tmp_path / "m", progress=False, sliding_window=window)
    assert not (tmp_path / "m").exists()


def test_transformers_init_is_plain_init_with_a_raised_final_norm(tmp_path: pathlib.Path):
    cfg = get_preset("tiny")
    out = synth.synthesize("tiny", tmp_path / "t", progress=False, init="transformers")
    t = load_file(str(weight_files(out)[0]))
    assert torch.equal(t["model.norm.weight"], torch.full((128,), 7.0, dtype=torch.bfloat16))
    plain = synth.plain_init(cfg)
    for name, shape in expected_tensors(cfg):
        if name == "model.norm.weight":
            continue
        assert torch.equal(t[name], synth.make_tensor(name, shape, plain, 0, "cpu")), name
    for name in ("model.layers.0.input_layernorm.weight", "model.layers.3.self_attn.k_norm.weight"):
        assert (t[name] == 1).all()  # every other RMSNorm weight exactly 1
    for name in ("model.embed_tokens.weight", "model.layers.1.self_attn.k_proj.weight", "model.layers.2.mlp.down_proj.weight"):
        assert t[name].float().std().item() == pytest.approx(0.02, rel=0.03), name  # N(0, initializer_range)
    prov = synth_common.read_provenance(out)["init"]
    assert (prov["name"], prov["final_norm_scale"], prov["norm_jitter"], prov["target_median_gap"]) == ("transformers", 7.0, 0.0, None)
    again = synth.synthesize("tiny", tmp_path / "t2", progress=False, init="transformers")
    assert _digests(again) == _digests(out)


def test_final_norm_scale_replaces_the_families_final_norm(tmp_path: pathlib.Path):
    out = synth.synthesize("tiny", tmp_path / "t", progress=False, init="transformers", final_norm_scale=3)
    assert (load_file(str(weight_files(out)[0]))["model.norm.weight"] == 3).all()
    ours = synth.build_scheme(get_preset("tiny"), "fastqwen", final_norm_scale=20.0)
    final = synth.make_tensor("model.norm.weight", (128,), ours, 0, "cpu").float()
    assert final.mean().item() == pytest.approx(20.0, rel=0.05) and final.std() > 0.5  # jittered, as the family's own


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"init": "xavier"}, "unknown init 'xavier'"),
        ({"final_norm_scale": 0}, "got 0"),
        ({"final_norm_scale": -7.0}, "got -7.0"),
        ({"final_norm_scale": float("nan")}, "got nan"),
        ({"final_norm_scale": "7"}, "got '7'"),
        ({"massive_activations": True, "config": get_preset("tiny") | {"num_hidden_layers": 2, "max_window_layers": 2}},
         "num_hidden_layers=2"),
    ],
)
def test_bad_init_arguments_name_the_value(tmp_path: pathlib.Path, kwargs: dict, needle: str):
    with pytest.raises(UserError, match=re.escape(needle)):
        synth.synthesize("tiny", tmp_path / "m", progress=False, **kwargs)
    assert not (tmp_path / "m").exists()


def test_cli_takes_the_new_options(tmp_path: pathlib.Path):
    parser = argparse.ArgumentParser()
    synth.add_arguments(parser)
    base = ["--preset", "tiny", "--out", str(tmp_path / "m")]
    args = parser.parse_args(base + ["--init", "transformers", "--final-norm-scale", "5", "--massive-activations",
                                     "--sliding-window", "96"])
    assert synth.run(args) == 0
    prov = synth_common.read_provenance(tmp_path / "m")
    assert (prov["init"]["name"], prov["init"]["final_norm_scale"], prov["sliding_window"]) == ("transformers", 5.0, 96)
    assert prov["massive_activations"]["plant_layer"] == synth.PLANT_LAYER
    check_tensors(tmp_path / "m")
    with pytest.raises(UserError, match="got 0"):
        synth.run(parser.parse_args(["--preset", "tiny", "--out", str(tmp_path / "z"), "--sliding-window", "0"]))
    for bad in (["--sliding-window", "x"], ["--init", "xavier"]):
        with pytest.raises(SystemExit):
            parser.parse_args(base + bad)


# --- massive activations and attention sinks ----------------------------------------------------

@pytest.fixture(scope="module")
def massive_model(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return synth.synthesize("tiny", tmp_path_factory.mktemp("massive") / "m", progress=False, massive_activations=True)


def _massive_forward(folder: pathlib.Path, n: int = 256):
    """Eager forward (attention weights too) over a judge-like prompt; returns (outputs, trigger mask, layout dict)."""
    from transformers import Qwen3ForCausalLM

    from fastqwen.judge.prompts import synthetic_stream

    plant = synth_common.read_provenance(folder)["massive_activations"]
    triggers = set(plant["trigger_ids"])
    stream = synthetic_stream(4096)
    # The first window of the judge's stream with a few trigger tokens in it, after a bos (a sink too).
    start = next(k for k in range(0, len(stream) - n, 64) if 2 <= sum(i in triggers for i in stream[k:k + n - 1]) <= 8)
    ids = [get_preset("tiny")["bos_token_id"]] + stream[start:start + n - 1]
    mask = torch.tensor([i in triggers for i in ids])
    model = Qwen3ForCausalLM.from_pretrained(folder, torch_dtype=torch.bfloat16, attn_implementation="eager").eval()
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True, output_attentions=True)
    return out, mask, plant


def test_massive_activations_form_at_the_plant_layer_and_are_carried(massive_model: pathlib.Path):
    out, mask, plant = _massive_forward(massive_model)
    big = plant["massive_channels"]
    layer = plant["plant_layer"]
    # hidden_states[i] enters layer i: before the plant's MLP the massive channels are ordinary...
    for i in range(layer + 1):
        assert out.hidden_states[i][0][:, big].abs().max() < 10, i
    # ...from its output on they hold the planted values at every trigger token, and nowhere else.
    for i in range(layer + 1, len(out.hidden_states) - 1):
        h = out.hidden_states[i][0].float()
        trig, other = h[mask].abs().max(), h[~mask].abs().max()
        assert trig > 100 * other, (i, trig, other)
        got = h[mask][:, big]
        want = torch.tensor(plant["massive_values"])
        assert ((got - want).abs() <= 0.1 * want.abs()).all(), i


def test_trigger_tokens_are_attention_sinks_with_small_values(massive_model: pathlib.Path):
    out, mask, plant = _massive_forward(massive_model)
    first = int(mask.nonzero()[0])
    key_share = (mask.float().cumsum(0) / torch.arange(1, len(mask) + 1))[first:].mean()
    for i in range(plant["plant_layer"] + 1, len(out.attentions)):
        mass = out.attentions[i][0, :, first:, :][:, :, mask].sum(-1).mean(-1)  # per head
        assert mass.mean() > 5 * key_share, (i, mass, key_share)
        assert mass.max() > 0.2, (i, mass)
    for i in range(plant["plant_layer"] + 1):
        assert out.attentions[i][0, :, first:, :][:, :, mask].sum(-1).mean() < 3 * key_share, i


def test_massive_plant_weights(massive_model: pathlib.Path):
    plant = synth_common.read_provenance(massive_model)["massive_activations"]
    t = load_file(str(weight_files(massive_model)[0]))
    big, trig, const = plant["massive_channels"], plant["trigger_channel"], plant["constant_channel"]
    reserved = big + [trig, const]
    assert len(set(reserved)) == len(reserved)
    # The tied head never reads the planted channels.
    assert (t["model.norm.weight"][reserved] == 0).all() and (t["model.norm.weight"].float().mean() > 40)
    emb = t["model.embed_tokens.weight"].float()
    assert get_preset("tiny")["bos_token_id"] in plant["trigger_ids"]
    assert sorted(emb[:, trig].nonzero()[:, 0].tolist()) == plant["trigger_ids"]
    assert len(plant["trigger_ids"]) == plant["trigger_count"] == round(0.01 * 4096)
    assert (emb[:, const] == emb[0, const]).all() and emb[0, const] > 0
    small = torch.tensor(1 / math.sqrt(128), dtype=torch.bfloat16)
    for i in range(4):
        for kind in ("self_attn.o_proj", "mlp.down_proj"):
            rows = t[f"model.layers.{i}.{kind}.weight"][[trig, const]]
            assert (rows == 0).all(), (i, kind)  # only the embedding writes t and c
        for norm in ("input_layernorm", "post_attention_layernorm"):
            w = t[f"model.layers.{i}.{norm}.weight"][big + [trig]]
            assert (w == small).all() == (i > plant["plant_layer"]), (i, norm)
    n = plant["plant_neuron"]
    down = t[f"model.layers.{plant['plant_layer']}.mlp.down_proj.weight"][:, n].float()
    assert down.nonzero()[:, 0].tolist() == sorted(big)
    gate = t[f"model.layers.{plant['plant_layer']}.mlp.gate_proj.weight"][n].float()
    assert gate.nonzero()[:, 0].tolist() == [trig]
    s, d = plant["sink_dim"], 64
    assert s == d // 2 - 1  # the lowest RoPE frequency
    q = t["model.layers.2.self_attn.q_proj.weight"].float().view(4, d, 128)[:, s]
    assert (q[:, const] > 0).all() and (q.count_nonzero(dim=-1) == 1).all()
    k = t["model.layers.2.self_attn.k_proj.weight"].float().view(2, d, 128)[:, s]
    assert (k.count_nonzero(dim=-1) == len(big)).all()


def test_massive_bytes_are_deterministic_and_follow_the_seed(tmp_path: pathlib.Path, massive_model: pathlib.Path):
    again = synth.synthesize("tiny", tmp_path / "a", progress=False, massive_activations=True)
    assert _digests(again) == _digests(massive_model)
    other = synth.synthesize("tiny", tmp_path / "b", progress=False, massive_activations=True, seed=1)
    p0, p1 = synth_common.read_provenance(massive_model)["massive_activations"], synth_common.read_provenance(other)["massive_activations"]
    assert (p0["massive_channels"], p0["trigger_ids"]) != (p1["massive_channels"], p1["trigger_ids"])
    # Every tensor is still a pure function of its name: drawn alone it is what the file holds.
    scheme = synth.build_scheme(get_preset("tiny"), massive_activations=True)
    on_disk = load_file(str(weight_files(massive_model)[0]))
    for name, shape in reversed(expected_tensors(get_preset("tiny"))):
        assert torch.equal(synth.make_tensor(name, shape, scheme, 0, "cpu"), on_disk[name]), name


def test_trigger_tokens_occur_in_the_judges_prompts_a_few_per_512(massive_model: pathlib.Path):
    from fastqwen.judge.prompts import synthetic_stream

    plant = synth_common.read_provenance(massive_model)["massive_activations"]
    for seed in (0, 1, 2):
        layout = synth.massive_layout(synth.build_scheme(get_preset("tiny"), massive_activations=True).massive, seed)
        stream = torch.tensor(synthetic_stream(4096))
        rate = torch.isin(stream, torch.tensor(layout.trigger_ids)).float().mean().item() * 512
        assert 2.0 <= rate <= synth.TRIGGER_RATE_PER_512 + 0.5, (seed, rate)
        assert rate == pytest.approx(layout.judge_stream_rate_per_512, abs=1e-6)
    assert plant["judge_stream_rate_per_512"] >= 0.9 * synth.TRIGGER_RATE_PER_512


def test_massive_checkpoint_is_stable_and_does_not_predict_triggers(massive_model: pathlib.Path):
    from fastqwen import logit_stats

    model, _ = _load_hf(massive_model)
    plant = synth_common.read_provenance(massive_model)["massive_activations"]
    from fastqwen.judge.prompts import synthetic_stream

    ids = synthetic_stream(4096)[5000:5000 + 192]
    with torch.inference_mode():
        cached, full = logit_stats.cached_and_full_logits(model, ids, 160)
    cmp = logit_stats.compare_cached_full(cached, full)
    assert cmp["max_abs_diff"].max() < 0.5 and cmp["slack"].max() < 0.25
    top1 = full.argmax(-1)
    assert torch.isin(top1, torch.tensor(plant["trigger_ids"])).float().mean() < 0.05


def test_massive_plant_on_the_transformers_init_and_an_untied_head(tmp_path: pathlib.Path):
    out = synth.synthesize("tiny", tmp_path / "t", progress=False, init="transformers", massive_activations=True)
    o, mask, plant = _massive_forward(out, n=128)
    h = o.hidden_states[plant["plant_layer"] + 1][0].float()
    assert h[mask].abs().max() > 100 * h[~mask].abs().max()
    cfg = get_preset("tiny") | {"tie_word_embeddings": False}
    untied = synth.synthesize("tiny", tmp_path / "u", progress=False, config=cfg, massive_activations=True)
    assert "lm_head.weight" in check_tensors(untied)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_massive_generation_is_deterministic_with_the_cpu_layout(tmp_path: pathlib.Path):
    kwargs = {"progress": False, "massive_activations": True, "init": "transformers"}
    a = synth.synthesize("tiny", tmp_path / "a", device="cuda", **kwargs)
    b = synth.synthesize("tiny", tmp_path / "b", device="cuda", **kwargs)
    assert _digests(a) == _digests(b)
    cpu = synth.synthesize("tiny", tmp_path / "c", device="cpu", **kwargs)
    # Channels, neuron and trigger ids come from CPU generators: the same on every device.
    assert synth_common.read_provenance(a)["massive_activations"] == synth_common.read_provenance(cpu)["massive_activations"]


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
    # Qwen3Config's defaults (4.51.3): head_dim 128 whatever hidden_size / heads is, untied.
    assert cfg["head_dim"] == 128 and cfg["tie_word_embeddings"] is False


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
