"""The one place the tools check a model folder (Qwen3 or Qwen3.5): its config, its weight files,
its tensors, and the tensors each family's config implies (`expected_tensors`).

Every check reads only `config.json`, the index and the safetensors headers
(8-byte length + JSON), never tensor data, so checking the 8 GB 4B folder is
instant. Problems a user can cause raise `UserError` naming the path, field or
tensor; nothing here imports torch.
"""
from __future__ import annotations

import json
import math
import pathlib
import struct

from fastqwen.errors import UserError
from fastqwen.refenv import QWEN35_MODEL_TYPES

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"

# Fields the engine and the tools read; each must be a positive integer.
REQUIRED_INT_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
)
# Fields that must be positive numbers.
REQUIRED_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta")

# A safetensors header larger than this is not a header (the format caps it at 100 MB).
_MAX_HEADER_BYTES = 100_000_000


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_positive_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _model_dir(model_dir: str | pathlib.Path) -> pathlib.Path:
    path = pathlib.Path(model_dir)
    if not path.exists():
        raise UserError(f"model folder {str(path)!r} does not exist")
    if not path.is_dir():
        raise UserError(f"model path {str(path)!r} is not a folder")
    return path


def _read_json(path: pathlib.Path) -> object:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{str(path)!r} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
    except UnicodeDecodeError:
        raise UserError(f"{str(path)!r} is not UTF-8 text") from None


# Qwen3Config's head_dim default (transformers 4.51.3), used when config.json has none.
QWEN3_DEFAULT_HEAD_DIM = 128


def read_config(model_dir: str | pathlib.Path) -> dict:
    """`config.json` of a Qwen3 or Qwen3.5 model folder, checked, as a dict.

    Qwen3.5 configs are read by `_read_qwen35_config`. For Qwen3, fills the two
    fields Transformers defaults when absent, so every reader sees the same values
    Transformers uses: `head_dim` (128 in 4.51.3's Qwen3Config, whatever
    hidden_size / num_attention_heads is) and `tie_word_embeddings` (False in
    Qwen3Config). An explicit null head_dim is an error (the reference cannot
    build the model from it).
    Raises UserError for a missing folder, a missing or malformed config.json, a
    model_type other than qwen3 and the Qwen3.5 types, or a missing or invalid
    required field.
    """
    path = _model_dir(model_dir) / CONFIG_NAME
    if not path.is_file():
        raise UserError(f"{str(path)!r} is missing: a model folder needs its config.json")
    cfg = _read_json(path)
    if not isinstance(cfg, dict):
        raise UserError(f"{str(path)!r} must hold a JSON object, not {type(cfg).__name__}")
    model_type = cfg.get("model_type")
    if model_type in QWEN35_MODEL_TYPES:
        return _read_qwen35_config(path, cfg)
    if model_type != "qwen3":
        raise UserError(f"{str(path)!r}: model_type is {model_type!r}; supported: 'qwen3', "
                        + ", ".join(repr(t) for t in sorted(QWEN35_MODEL_TYPES)))
    for field in REQUIRED_INT_FIELDS:
        if field not in cfg:
            raise UserError(f"{str(path)!r}: required field {field!r} is missing")
        if not _is_positive_int(cfg[field]):
            raise UserError(f"{str(path)!r}: field {field!r} must be a positive integer, got {cfg[field]!r}")
    for field in REQUIRED_FLOAT_FIELDS:
        if field not in cfg:
            raise UserError(f"{str(path)!r}: required field {field!r} is missing")
        if not _is_positive_number(cfg[field]):
            raise UserError(f"{str(path)!r}: field {field!r} must be a positive number, got {cfg[field]!r}")
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    if heads % kv_heads != 0:
        raise UserError(
            f"{str(path)!r}: num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})"
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UserError(f"{str(path)!r}: hidden_act is {act!r}; Qwen3 uses 'silu'")
    out = dict(cfg)
    if "head_dim" not in out:
        out["head_dim"] = QWEN3_DEFAULT_HEAD_DIM
    elif not _is_positive_int(out["head_dim"]):
        raise UserError(f"{str(path)!r}: field 'head_dim' must be a positive integer, got {out['head_dim']!r}")
    out.setdefault("tie_word_embeddings", False)
    return out


QWEN35_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
                     "linear_key_head_dim", "linear_value_head_dim")


def _read_qwen35_config(path: pathlib.Path, cfg: dict) -> dict:
    """A Qwen3.5 config.json (the text model's, or the released wrapper's text_config with
    its tie_word_embeddings), its shape fields checked; model_type qwen3_5_text."""
    if cfg.get("model_type") == "qwen3_5":
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise UserError(f"{str(path)!r}: model_type 'qwen3_5' needs a text_config object")
        cfg = {**text, "tie_word_embeddings": cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)),
               "model_type": "qwen3_5_text"}
    for field in QWEN35_INT_FIELDS:
        if not _is_positive_int(cfg.get(field)):
            raise UserError(f"{str(path)!r}: field {field!r} must be a positive integer, got {cfg.get(field)!r}")
    return dict(cfg)


def expected_tensors(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor a checkpoint holds for `config` (Qwen3 or Qwen3.5), as (name, shape), in model order.

    `lm_head.weight` is listed only when embeddings are not tied (Hugging Face
    omits it from tied checkpoints).
    """
    if config.get("model_type") in QWEN35_MODEL_TYPES:
        return qwen35_expected_tensors(config)
    hidden = int(config["hidden_size"])
    inter = int(config["intermediate_size"])
    vocab = int(config["vocab_size"])
    head_dim = int(config.get("head_dim", QWEN3_DEFAULT_HEAD_DIM))
    q_out = int(config["num_attention_heads"]) * head_dim
    kv_out = int(config["num_key_value_heads"]) * head_dim
    specs: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}."
        specs += [
            (p + "input_layernorm.weight", (hidden,)),
            (p + "self_attn.q_proj.weight", (q_out, hidden)),
            (p + "self_attn.k_proj.weight", (kv_out, hidden)),
            (p + "self_attn.v_proj.weight", (kv_out, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, q_out)),
            (p + "self_attn.q_norm.weight", (head_dim,)),
            (p + "self_attn.k_norm.weight", (head_dim,)),
            (p + "post_attention_layernorm.weight", (hidden,)),
            (p + "mlp.gate_proj.weight", (inter, hidden)),
            (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
        ]
    specs.append(("model.norm.weight", (hidden,)))
    if not config.get("tie_word_embeddings", False):
        specs.append(("lm_head.weight", (vocab, hidden)))
    return specs


# Qwen3.5 puts a gated full-attention layer after every three Gated DeltaNet layers.
QWEN35_FULL_ATTENTION_INTERVAL = 4


def qwen35_layer_types(layers: int) -> list[str]:
    """Qwen3.5's default `layer_types` for `layers` layers (what its config.json lists)."""
    return ["full_attention" if (i + 1) % QWEN35_FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
            for i in range(layers)]


def qwen35_expected_tensors(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a Qwen3.5 text checkpoint, (name, shape), in model order (tied: no lm_head)."""
    h, inter, vocab = (int(config[k]) for k in ("hidden_size", "intermediate_size", "vocab_size"))
    hd, heads, kvh = int(config["head_dim"]), int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    kd, vd = int(config["linear_key_head_dim"]), int(config["linear_value_head_dim"])
    kh, vh = int(config["linear_num_key_heads"]), int(config["linear_num_value_heads"])
    conv_dim, width = 2 * kh * kd + vh * vd, int(config["linear_conv_kernel_dim"])
    specs: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i, kind in enumerate(config.get("layer_types") or qwen35_layer_types(int(config["num_hidden_layers"]))):
        p = f"model.layers.{i}."
        if kind == "linear_attention":
            a = p + "linear_attn."
            specs += [(a + "dt_bias", (vh,)), (a + "A_log", (vh,)), (a + "conv1d.weight", (conv_dim, 1, width)),
                      (a + "norm.weight", (vd,)), (a + "out_proj.weight", (h, vh * vd)),
                      (a + "in_proj_qkv.weight", (conv_dim, h)), (a + "in_proj_z.weight", (vh * vd, h)),
                      (a + "in_proj_b.weight", (vh, h)), (a + "in_proj_a.weight", (vh, h))]
        elif kind == "full_attention":
            a = p + "self_attn."
            specs += [(a + "q_proj.weight", (2 * heads * hd, h)), (a + "k_proj.weight", (kvh * hd, h)),
                      (a + "v_proj.weight", (kvh * hd, h)), (a + "o_proj.weight", (h, heads * hd)),
                      (a + "q_norm.weight", (hd,)), (a + "k_norm.weight", (hd,))]
        else:
            raise UserError(f"layer {i}: unknown layer type {kind!r}")
        specs += [(p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                  (p + "mlp.down_proj.weight", (h, inter)), (p + "input_layernorm.weight", (h,)),
                  (p + "post_attention_layernorm.weight", (h,))]
    specs.append(("model.norm.weight", (h,)))
    if not config.get("tie_word_embeddings", False):
        specs.append(("lm_head.weight", (vocab, h)))
    return specs


def mtp_tensors(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """The multi-token-prediction head a released Qwen3.5 checkpoint carries beside the model
    (`mtp.*`, config `mtp_num_hidden_layers`; none for Qwen3 or without the field): `fc` over the
    normed embedding and hidden state side by side, its two norms, that many gated full-attention
    decoder layers and a final norm. Not part of the model's own parameters (expected_tensors): the
    plain decode never reads them."""
    layers = int(config.get("mtp_num_hidden_layers") or 0) if config.get("model_type") in QWEN35_MODEL_TYPES else 0
    if not layers:
        return []
    h, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    hd, heads, kvh = int(config["head_dim"]), int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    specs = [("mtp.fc.weight", (h, 2 * h)), ("mtp.pre_fc_norm_embedding.weight", (h,)),
             ("mtp.pre_fc_norm_hidden.weight", (h,))]
    for n in range(layers):
        p, a = f"mtp.layers.{n}.", f"mtp.layers.{n}.self_attn."
        specs += [(a + "q_proj.weight", (2 * heads * hd, h)), (a + "k_proj.weight", (kvh * hd, h)),
                  (a + "v_proj.weight", (kvh * hd, h)), (a + "o_proj.weight", (h, heads * hd)),
                  (a + "q_norm.weight", (hd,)), (a + "k_norm.weight", (hd,)),
                  (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                  (p + "mlp.down_proj.weight", (h, inter)), (p + "input_layernorm.weight", (h,)),
                  (p + "post_attention_layernorm.weight", (h,))]
    specs.append(("mtp.norm.weight", (h,)))
    return specs


def _read_index(index_path: pathlib.Path) -> dict[str, str]:
    index = _read_json(index_path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise UserError(f"{str(index_path)!r} has no 'weight_map' object")
    for name, fname in weight_map.items():
        # A shard name with a folder part could point outside the model folder.
        if not isinstance(fname, str) or pathlib.PurePath(fname).name != fname:
            raise UserError(f"{str(index_path)!r}: tensor {name!r} maps to an invalid file name {fname!r}")
    return weight_map


def weight_files(model_dir: str | pathlib.Path) -> list[pathlib.Path]:
    """The safetensors files of a model folder: the index's shards (sorted), or the single file.

    Raises UserError when there are no weights, the index is malformed, or a shard it names is missing.
    """
    folder = _model_dir(model_dir)
    index_path = folder / INDEX_NAME
    if index_path.is_file():
        files = sorted(set(_read_index(index_path).values()))
        paths = [folder / f for f in files]
        for p in paths:
            if not p.is_file():
                raise UserError(f"shard {p.name!r} named in {str(index_path)!r} is missing")
        return paths
    single = folder / SINGLE_FILE_NAME
    if single.is_file():
        return [single]
    raise UserError(f"no weights in {str(folder)!r}: expected {INDEX_NAME} or {SINGLE_FILE_NAME}")


def read_safetensors_header(path: pathlib.Path) -> dict[str, dict]:
    """The tensor entries of a safetensors file's header ({name: {dtype, shape, data_offsets}}), without reading data."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise UserError(f"{str(path)!r} is too short to be a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER_BYTES:
                raise UserError(f"{str(path)!r} is not a safetensors file (header length {n})")
            raw = f.read(n)
    except OSError as exc:
        raise UserError(f"cannot read {str(path)!r}: {exc.strerror}") from None
    if len(raw) != n:
        raise UserError(f"{str(path)!r} is truncated inside its header")
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{str(path)!r} has a malformed safetensors header") from None
    if not isinstance(header, dict):
        raise UserError(f"{str(path)!r} has a malformed safetensors header")
    header.pop("__metadata__", None)
    return header


def check_tensors(model_dir: str | pathlib.Path) -> dict[str, tuple[int, ...]]:
    """Check tensor names and shapes against what config.json implies; return {name: shape}.

    Reads headers only. Raises UserError naming the first missing, unexpected,
    mis-shaped or misplaced tensor. A tied checkpoint may still carry
    `lm_head.weight` (some exporters write it; Transformers then ties over it),
    but only with the embedding's shape.
    """
    folder = _model_dir(model_dir)
    cfg = read_config(folder)
    files = weight_files(folder)
    index_path = folder / INDEX_NAME
    weight_map = _read_index(index_path) if index_path.is_file() else None

    found: dict[str, tuple[int, ...]] = {}
    where: dict[str, str] = {}
    for path in files:
        for name, entry in read_safetensors_header(path).items():
            if name in found:
                raise UserError(f"tensor {name!r} appears in both {where[name]!r} and {path.name!r}")
            shape = entry.get("shape") if isinstance(entry, dict) else None
            if not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
                raise UserError(f"tensor {name!r} in {path.name!r} has a malformed header entry")
            found[name] = tuple(shape)
            where[name] = path.name
    if weight_map is not None:
        for name, fname in weight_map.items():
            if name in where and where[name] != fname:
                raise UserError(f"tensor {name!r} is in {where[name]!r} but the index says {fname!r}")
            if name not in where:
                raise UserError(f"tensor {name!r} is listed in the index but not in shard {fname!r}")
        for name in found:
            if name not in weight_map:
                raise UserError(f"tensor {name!r} in {where[name]!r} is missing from the index")

    expected = dict(expected_tensors(cfg) + mtp_tensors(cfg))
    if cfg.get("tie_word_embeddings") and "lm_head.weight" in found:
        expected["lm_head.weight"] = expected["model.embed_tokens.weight"]
    for name, shape in expected.items():
        if name not in found:
            raise UserError(f"tensor {name!r} is missing from {str(folder)!r}")
        if found[name] != shape:
            raise UserError(f"tensor {name!r} has shape {list(found[name])}; config.json implies {list(shape)}")
    for name in found:
        if name not in expected:
            raise UserError(f"unexpected tensor {name!r} in {where[name]!r} (not part of a Qwen3 model with this config)")
    return found
