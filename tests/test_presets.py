"""Presets match the published Qwen3 config.json files and load as Transformers configs."""
from __future__ import annotations

import json
import pathlib

import pytest

from fastqwen.checkpoint import read_config
from fastqwen.errors import UserError
from fastqwen.presets import PRESETS, get_generation_config, get_preset, preset_names

# Qwen/Qwen3-4B-Instruct-2507 config.json, field for field (the checkpoint the platform runs).
QWEN3_4B_INSTRUCT_2507 = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2560,
    "initializer_range": 0.02,
    "intermediate_size": 9728,
    "max_position_embeddings": 262144,
    "max_window_layers": 36,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 5000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# (hidden, intermediate, layers, heads, kv heads, max positions, rope theta, tied) of the published configs.
PUBLISHED_SHAPES = {
    "qwen3-0.6b": (1024, 3072, 28, 16, 8, 40960, 1000000, True),
    "qwen3-1.7b": (2048, 6144, 28, 16, 8, 40960, 1000000, True),
    "qwen3-4b": (2560, 9728, 36, 32, 8, 262144, 5000000, True),
    "qwen3-8b": (4096, 12288, 36, 32, 8, 40960, 1000000, False),
}


def test_qwen3_4b_is_the_2507_config_exactly():
    assert get_preset("qwen3-4b") == QWEN3_4B_INSTRUCT_2507


@pytest.mark.parametrize("name", sorted(PUBLISHED_SHAPES))
def test_published_presets_key_fields(name: str):
    cfg = get_preset(name)
    hidden, inter, layers, heads, kv, max_pos, theta, tied = PUBLISHED_SHAPES[name]
    got = (
        cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
        cfg["num_key_value_heads"], cfg["max_position_embeddings"], cfg["rope_theta"], cfg["tie_word_embeddings"],
    )
    assert got == (hidden, inter, layers, heads, kv, max_pos, theta, tied)
    assert cfg["head_dim"] == 128 and cfg["vocab_size"] == 151936 and cfg["model_type"] == "qwen3"
    assert cfg["max_window_layers"] == layers
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (151643, 151645)


def test_tiny_has_the_agreed_numbers():
    cfg = get_preset("tiny")
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (128, 384, 4)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 64)
    assert (cfg["vocab_size"], cfg["max_position_embeddings"]) == (4096, 4096)
    assert (cfg["rope_theta"], cfg["rms_norm_eps"], cfg["tie_word_embeddings"]) == (1000000, 1e-6, True)
    # head_dim deliberately differs from hidden / heads, as in the real family.
    assert cfg["head_dim"] != cfg["hidden_size"] // cfg["num_attention_heads"]
    assert 0 <= cfg["bos_token_id"] < cfg["vocab_size"] and 0 <= cfg["eos_token_id"] < cfg["vocab_size"]
    gen = get_generation_config("tiny")
    assert all(0 <= t < cfg["vocab_size"] for t in gen["eos_token_id"] + [gen["bos_token_id"], gen["pad_token_id"]])


def test_generation_config_of_2507():
    assert get_generation_config("qwen3-4b") == {
        "bos_token_id": 151643,
        "do_sample": True,
        "eos_token_id": [151645, 151643],
        "pad_token_id": 151643,
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.8,
        "transformers_version": "4.51.0",
    }


def test_every_preset_has_a_generation_config():
    assert set(preset_names()) == set(PRESETS)
    for name in PRESETS:
        assert isinstance(get_generation_config(name)["eos_token_id"], list)


def test_get_preset_returns_a_deep_copy():
    cfg = get_preset("qwen3-4b")
    cfg["architectures"].append("Mutated")
    cfg["hidden_size"] = 1
    assert get_preset("qwen3-4b") == QWEN3_4B_INSTRUCT_2507
    gen = get_generation_config("qwen3-4b")
    gen["eos_token_id"].append(0)
    assert get_generation_config("qwen3-4b")["eos_token_id"] == [151645, 151643]


@pytest.mark.parametrize("getter", [get_preset, get_generation_config])
def test_unknown_preset_lists_the_known_names(getter):
    with pytest.raises(UserError) as info:
        getter("qwen3-5b")
    message = str(info.value)
    assert "qwen3-5b" in message
    for name in PRESETS:
        assert name in message


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_build_transformers_configs(name: str):
    from transformers import Qwen3Config

    cfg = get_preset(name)
    hf = Qwen3Config(**cfg)
    assert hf.head_dim == cfg["head_dim"]
    assert hf.tie_word_embeddings == cfg["tie_word_embeddings"]
    assert hf.num_key_value_heads == cfg["num_key_value_heads"]


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_pass_read_config(name: str, tmp_path: pathlib.Path):
    (tmp_path / "config.json").write_text(json.dumps(get_preset(name)))
    assert read_config(tmp_path) == get_preset(name)
