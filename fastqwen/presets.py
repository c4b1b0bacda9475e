"""Qwen3 model shapes as Hugging Face `config.json` / `generation_config.json` dicts.

The real presets copy the published files field for field, so a synthetic
checkpoint loads exactly as the real one would; only the weights differ.
`tiny` keeps the Qwen3 architecture (GQA, head_dim != hidden / heads, tied
embeddings, q/k norms) at a size the CPU test suite can run in seconds; other
code and tests are written against its exact numbers, so do not change them.
"""
from __future__ import annotations

import copy

from fastqwen.errors import UserError

# Fields every Qwen3 config.json carries, in the order the published files list them.
_QWEN3_COMMON: dict = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "model_type": "qwen3",
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "sliding_window": None,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def _config(**fields: object) -> dict:
    merged = {**_QWEN3_COMMON, **fields}
    return dict(sorted(merged.items()))  # the published files list keys alphabetically


PRESETS: dict[str, dict] = {
    # Qwen/Qwen3-4B-Instruct-2507, revision cdbee75f17c01a7cc42f958dc650907174af0554,
    # config.json: the checkpoint the platform runs.
    "qwen3-4b": _config(
        hidden_size=2560,
        intermediate_size=9728,
        max_position_embeddings=262144,
        max_window_layers=36,
        num_attention_heads=32,
        num_hidden_layers=36,
        num_key_value_heads=8,
        rope_theta=5000000,
        tie_word_embeddings=True,
    ),
    # Qwen/Qwen3-0.6B config.json.
    "qwen3-0.6b": _config(
        hidden_size=1024,
        intermediate_size=3072,
        max_position_embeddings=40960,
        max_window_layers=28,
        num_attention_heads=16,
        num_hidden_layers=28,
        num_key_value_heads=8,
        rope_theta=1000000,
        tie_word_embeddings=True,
    ),
    # Qwen/Qwen3-1.7B config.json.
    "qwen3-1.7b": _config(
        hidden_size=2048,
        intermediate_size=6144,
        max_position_embeddings=40960,
        max_window_layers=28,
        num_attention_heads=16,
        num_hidden_layers=28,
        num_key_value_heads=8,
        rope_theta=1000000,
        tie_word_embeddings=True,
    ),
    # Qwen/Qwen3-8B config.json: the one size here whose LM head is not tied.
    "qwen3-8b": _config(
        hidden_size=4096,
        intermediate_size=12288,
        max_position_embeddings=40960,
        max_window_layers=36,
        num_attention_heads=32,
        num_hidden_layers=36,
        num_key_value_heads=8,
        rope_theta=1000000,
        tie_word_embeddings=False,
    ),
    # Our own CPU-sized shape. head_dim 64 is deliberately not hidden / heads (32),
    # as in the real family, so code that derives head_dim from hidden_size fails here.
    "tiny": _config(
        bos_token_id=4094,
        eos_token_id=4095,
        head_dim=64,
        hidden_size=128,
        intermediate_size=384,
        max_position_embeddings=4096,
        max_window_layers=4,
        num_attention_heads=4,
        num_hidden_layers=4,
        num_key_value_heads=2,
        rope_theta=1000000,
        tie_word_embeddings=True,
        vocab_size=4096,
    ),
}

# generation_config.json per preset. The base Qwen3 models ship the "thinking"
# sampling defaults; the 2507 instruct model its own. Greedy engines ignore the
# sampling fields, but the file is part of a faithful model folder.
_BASE_GENERATION: dict = {
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "transformers_version": "4.51.0",
}

GENERATION_CONFIGS: dict[str, dict] = {
    # Qwen/Qwen3-4B-Instruct-2507 generation_config.json.
    "qwen3-4b": {**_BASE_GENERATION, "temperature": 0.7, "top_p": 0.8},
    "qwen3-0.6b": dict(_BASE_GENERATION),
    "qwen3-1.7b": dict(_BASE_GENERATION),
    "qwen3-8b": dict(_BASE_GENERATION),
    "tiny": {
        **_BASE_GENERATION,
        "bos_token_id": 4094,
        "eos_token_id": [4095, 4094],
        "pad_token_id": 4094,
        "temperature": 0.7,
        "top_p": 0.8,
    },
}


def preset_names() -> list[str]:
    """The known preset names, in definition order."""
    return list(PRESETS)


def _check_name(name: str) -> None:
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")


def get_preset(name: str) -> dict:
    """A deep copy of preset `name`'s config.json dict; UserError listing the known names otherwise."""
    _check_name(name)
    return copy.deepcopy(PRESETS[name])


def get_generation_config(name: str) -> dict:
    """A deep copy of preset `name`'s generation_config.json dict."""
    _check_name(name)
    return copy.deepcopy(GENERATION_CONFIGS[name])
