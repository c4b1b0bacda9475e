"""The model's shape, read once from `config.json` into a frozen dataclass.

Nothing past this module touches the raw dict: every dimension the engine
uses comes from here, so any Qwen3 dense size loads (0.6B to 8B and beyond).
"""
import json
import os
from dataclasses import dataclass

_REQUIRED = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "rope_theta",
    "max_position_embeddings",
)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def group_size(self) -> int:
        """Query heads per KV head (query head h reads KV head h // group_size)."""
        return self.num_heads // self.num_kv_heads

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.kv_size * 2

    @classmethod
    def from_dir(cls, model_path: str) -> "ModelConfig":
        path = os.path.join(model_path, "config.json")
        if not os.path.isdir(model_path):
            raise FileNotFoundError(f"model folder {model_path!r} does not exist")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no config.json in the model folder")
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict(raw, source=path)

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config") -> "ModelConfig":
        if not isinstance(raw, dict):
            raise ValueError(f"{source}: expected a JSON object")
        if raw.get("model_type") != "qwen3":
            raise ValueError(f"{source}: model_type is {raw.get('model_type')!r}, this engine runs 'qwen3'")
        missing = [k for k in _REQUIRED if k not in raw]
        if missing:
            raise ValueError(f"{source}: missing field(s) {', '.join(missing)}")
        scaling = raw.get("rope_scaling")
        if scaling not in (None, {}) and (scaling.get("rope_type") or scaling.get("type")) != "default":
            raise ValueError(f"{source}: rope_scaling {scaling!r} is not supported (only plain RoPE)")
        if raw.get("attention_bias"):
            raise ValueError(f"{source}: attention_bias=true is not supported (Qwen3 has no biases)")
        if raw.get("use_sliding_window"):
            raise ValueError(f"{source}: use_sliding_window=true is not supported")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act {raw.get('hidden_act')!r} is not supported (only silu)")
        heads, kv_heads = int(raw["num_attention_heads"]), int(raw["num_key_value_heads"])
        head_dim = int(raw.get("head_dim") or raw["hidden_size"] // heads)
        if heads % kv_heads:
            raise ValueError(f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        if head_dim % 2 or head_dim & (head_dim - 1):
            raise ValueError(f"{source}: head_dim {head_dim} must be a power of two")
        dtype = raw.get("torch_dtype", "bfloat16")
        if dtype != "bfloat16":
            raise ValueError(f"{source}: torch_dtype {dtype!r}; this engine runs bfloat16 checkpoints")
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw["rms_norm_eps"]),
            rope_theta=float(raw["rope_theta"]),
            max_position_embeddings=int(raw["max_position_embeddings"]),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        )
