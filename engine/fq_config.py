"""The model's shape, read once from `config.json` into a frozen dataclass: Qwen3Config for the
dense family (model_type "qwen3"), Qwen35Config for the hybrid one ("qwen3_5_text", or "qwen3_5",
the released multimodal wrapper, whose text_config is read); `config_for` picks by model_type.

Nothing past this module touches the raw dict: every dimension the engine
uses comes from here, so any Qwen3 dense size loads (0.6B to 8B and beyond).

Qwen3. The reference is Transformers 4.51.3's `Qwen3ForCausalLM` (BF16, sdpa). Every
field of its `Qwen3Config` (and of `PretrainedConfig` that reaches the forward)
was checked for what it changes in that forward. A field absent from
config.json takes Qwen3Config's default, as Transformers does (`head_dim` is 128
there, not hidden_size / heads). A value that changes the reference's arithmetic
in a way the engine does not implement is refused at load with one line naming it:

  shapes (vocab_size, hidden_size, intermediate_size, num_hidden_layers,
    num_attention_heads, num_key_value_heads, head_dim), rms_norm_eps,
    rope_theta, tie_word_embeddings ........ read
  sliding_window ............................ read: a window in every layer (below)
  use_sliding_window ........................ false only (below)
  max_window_layers ......................... ignored, as the sdpa reference ignores it
  rope_scaling .............................. null or rope_type "default" only
  partial_rotary_factor ..................... absent or 1 only (it shortens the rotary part)
  hidden_act ................................ "silu" only
  attention_bias ............................ false only
  output_attentions ......................... false only (true sends the reference to eager attention)
  quantization_config ....................... refused: the engine runs unquantized weights
  torch_dtype ............................... bfloat16, float16 or float32: the weights are cast
                                              to BF16 at load, as the reference loads them
  max_position_embeddings ................... not used by plain RoPE; the engine refuses calls past it
  attention_dropout, initializer_range, use_cache, token ids, output_hidden_states: no effect

Sliding window (the one non-obvious rule). 4.51.3 builds its causal mask with a
window whenever `sliding_window` is not null, in every layer, whatever
`use_sliding_window` and `max_window_layers` say (those two only reach the
attention function as an argument the sdpa path ignores): query position p sees
keys j with p - sliding_window < j <= p. Qwen3Config's own default is a window of
4096, so a checkpoint saved from a default config carries one. The engine keeps
the same rule (`sliding_window` below; fq_attention.prefill_attention and the decode
attention kernels apply it). Newer Transformers drop the window when
use_sliding_window is false and apply it per layer otherwise: that is why
use_sliding_window=true is refused rather than guessed.
"""
import json
import os
from dataclasses import dataclass

# Qwen3Config's defaults (transformers 4.51.3, configuration_qwen3.py) for the fields the
# engine reads, used when config.json lacks them. The refused fields' defaults are the values
# `_refuse_unsupported` accepts.
DEFAULTS = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
}

# torch_dtype values whose tensors load as the reference loads them (cast to BF16 at load).
WEIGHT_DTYPES = ("bfloat16", "float16", "float32")
QWEN35_MODEL_TYPES = ("qwen3_5_text", "qwen3_5")
MODEL_TYPES = ("qwen3",) + QWEN35_MODEL_TYPES


def read_config(model_path: str) -> dict:
    """config.json of a checkpoint folder as a dict; a missing folder or file, or bad JSON, is an
    error naming it."""
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
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return raw


def config_for(model_path: str):
    """The checkpoint's config: a Qwen35Config for a Qwen3.5 model_type, else a Qwen3Config (which
    refuses any other model_type, naming it)."""
    raw = read_config(model_path)
    if raw.get("model_type") in QWEN35_MODEL_TYPES:
        return Qwen35Config.from_dict(raw)
    return Qwen3Config.from_dict(raw, source=os.path.join(model_path, "config.json"))


@dataclass(frozen=True)
class Qwen3Config:
    """A Qwen3 dense model's shape (the module doc lists how each config.json field is read)."""

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
    sliding_window: int | None = None  # keys per query (itself included); None: full causal attention

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
    def from_dir(cls, model_path: str) -> "Qwen3Config":
        return cls.from_dict(read_config(model_path), source=os.path.join(model_path, "config.json"))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config") -> "Qwen3Config":
        if not isinstance(raw, dict):
            raise ValueError(f"{source}: expected a JSON object")
        if raw.get("model_type") != "qwen3":
            raise ValueError(f"{source}: model_type is {raw.get('model_type')!r}, this engine runs "
                             f"{', '.join(repr(m) for m in MODEL_TYPES)}")
        _refuse_unsupported(raw, source)
        get = {k: raw.get(k, v) for k, v in DEFAULTS.items()}.__getitem__

        def positive_int(name: str) -> int:
            value = get(name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{source}: {name} must be a positive integer, got {value!r}")
            return value

        def positive_number(name: str) -> float:
            value = get(name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{source}: {name} must be a positive number, got {value!r}")
            return float(value)

        heads, kv_heads = positive_int("num_attention_heads"), positive_int("num_key_value_heads")
        head_dim = positive_int("head_dim")
        if heads % kv_heads:
            raise ValueError(f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        if head_dim % 2 or head_dim & (head_dim - 1):
            raise ValueError(f"{source}: head_dim {head_dim} must be a power of two")
        window = get("sliding_window")
        if window is not None:
            window = positive_int("sliding_window")
        return cls(
            vocab_size=positive_int("vocab_size"),
            hidden_size=positive_int("hidden_size"),
            intermediate_size=positive_int("intermediate_size"),
            num_layers=positive_int("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=positive_number("rms_norm_eps"),
            rope_theta=positive_number("rope_theta"),
            max_position_embeddings=positive_int("max_position_embeddings"),
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            sliding_window=window,
        )


def _refuse_unsupported(raw: dict, source: str) -> None:
    """One clear line for any field value that changes the reference's forward in a way
    the engine does not implement (the table in the module doc)."""
    scaling = raw.get("rope_scaling")
    if scaling not in (None, {}):
        kind = (scaling.get("rope_type") or scaling.get("type")) if isinstance(scaling, dict) else None
        if kind != "default":
            raise ValueError(f"{source}: rope_scaling {scaling!r} is not supported (only plain RoPE)")
    factor = raw.get("partial_rotary_factor", 1.0)
    if factor not in (1, 1.0):
        raise ValueError(f"{source}: partial_rotary_factor {factor!r} is not supported (RoPE on the whole head only)")
    if raw.get("attention_bias"):
        raise ValueError(f"{source}: attention_bias=true is not supported (Qwen3 has no biases)")
    if raw.get("use_sliding_window"):
        raise ValueError(f"{source}: use_sliding_window=true is not supported (Transformers versions disagree on "
                         f"which layers it windows; a window in every layer is read from sliding_window alone)")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act {raw.get('hidden_act')!r} is not supported (only silu)")
    if raw.get("output_attentions"):
        raise ValueError(f"{source}: output_attentions=true is not supported (it makes the reference run its "
                         f"eager attention instead of sdpa)")
    if raw.get("quantization_config") is not None:
        raise ValueError(f"{source}: quantization_config is set; this engine runs unquantized checkpoints only")
    dtype = raw.get("torch_dtype", "bfloat16")
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"{source}: torch_dtype {dtype!r} is not supported (one of {', '.join(WEIGHT_DTYPES)})")


# ---------------------------------------------------------------------------- Qwen3.5

@dataclass(frozen=True)
class Qwen35Config:
    """A Qwen3.5 text model's shape (Transformers 5.17's Qwen3_5TextConfig fields the engine reads):
    `layer_types` lists each layer's mixer ("linear_attention": Gated DeltaNet, "full_attention":
    gated attention); the RoPE covers rotary_dim = head_dim * partial_rotary_factor dims. A field
    whose value the engine does not compute (another rope_type, attention biases, another
    activation) is refused in from_dict, naming it."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    layer_types: tuple
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    linear_k_heads: int
    linear_v_heads: int
    linear_k_dim: int
    linear_v_dim: int
    conv_width: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    mtp_layers: int = 0          # the multi-token-prediction head's decoder layers (mtp_num_hidden_layers)

    model_type = "qwen3_5_text"

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_k_heads * self.linear_k_dim + self.linear_v_heads * self.linear_v_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, model_dir: str) -> "Qwen35Config":
        return cls.from_dict(read_config(model_dir))

    @classmethod
    def from_dict(cls, raw: dict) -> "Qwen35Config":
        if raw.get("model_type") == "qwen3_5":
            tie = raw.get("tie_word_embeddings", raw.get("text_config", {}).get("tie_word_embeddings", False))
            raw = dict(raw.get("text_config") or {}, tie_word_embeddings=tie)
        def need(key):
            if key not in raw:
                raise ValueError(f"config.json: Qwen3.5 field {key!r} is missing")
            return raw[key]
        rope = raw.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"config.json: rope_type {rope.get('rope_type')!r} is not supported (default only)")
        if raw.get("attention_bias", False):
            raise ValueError("config.json: attention_bias true is not supported")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: hidden_act {raw.get('hidden_act')!r} is not supported (silu only)")
        layers = int(need("num_hidden_layers"))
        types = tuple(raw.get("layer_types") or ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                                 for i in range(layers)])
        bad = sorted(set(types) - {"full_attention", "linear_attention"})
        if bad or len(types) != layers:
            raise ValueError(f"config.json: layer_types must list {layers} of full_attention / linear_attention, "
                             f"got {bad or len(types)}")
        head_dim = int(raw.get("head_dim", 256))
        partial = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25)))
        for many, few in (("num_attention_heads", "num_key_value_heads"),
                          ("linear_num_value_heads", "linear_num_key_heads")):
            if int(need(few)) < 1 or int(need(many)) % int(need(few)):
                raise ValueError(f"config.json: {many} ({raw[many]}) must be a multiple of {few} ({raw[few]})")
        if int(head_dim * partial) % 2 or not 0 < partial <= 1:
            raise ValueError(f"config.json: partial_rotary_factor {partial} of head_dim {head_dim} must give an even "
                             "number of rotary dims")
        return cls(
            vocab_size=int(need("vocab_size")), hidden_size=int(need("hidden_size")),
            intermediate_size=int(need("intermediate_size")), num_layers=layers, layer_types=types,
            num_heads=int(need("num_attention_heads")), num_kv_heads=int(need("num_key_value_heads")),
            head_dim=head_dim, rotary_dim=int(head_dim * partial), rope_theta=float(rope.get("rope_theta", 10000.0)),
            linear_k_heads=int(need("linear_num_key_heads")), linear_v_heads=int(need("linear_num_value_heads")),
            linear_k_dim=int(need("linear_key_head_dim")), linear_v_dim=int(need("linear_value_head_dim")),
            conv_width=int(raw.get("linear_conv_kernel_dim", 4)), rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            mtp_layers=int(raw.get("mtp_num_hidden_layers") or 0),
        )
