"""Load a checkpoint's safetensors shards onto the device: Qwen3 (load_weights) and Qwen3.5
(load_qwen35_weights).

Q/K/V and gate/up are packed into one matrix each at load time so a decode
step reads each layer's input once per fused product. Every tensor's name and
shape is checked against the config: a missing, unexpected or mis-shaped
tensor is an error that names it.
"""
import json
import os
from contextlib import ExitStack
from dataclasses import dataclass

import torch
from safetensors import safe_open

from fq_config import Qwen35Config, Qwen3Config

# Checkpoint dtypes the loader takes; every weight is held in BF16 on the device.
_LOADABLE = (torch.bfloat16, torch.float16, torch.float32)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor   # [hidden]
    qkv: torch.Tensor          # [(H + 2 KVH) * D, hidden]: q rows, then k rows, then v rows
    q_norm: torch.Tensor       # [D]
    k_norm: torch.Tensor       # [D]
    o: torch.Tensor            # [hidden, H * D]
    post_norm: torch.Tensor    # [hidden]
    gate_up: torch.Tensor      # [2 I, hidden]: gate rows, then up rows
    down: torch.Tensor         # [hidden, I]


@dataclass
class ModelWeights:
    embed: torch.Tensor        # [vocab, hidden]
    layers: list
    final_norm: torch.Tensor   # [hidden]
    lm_head: torch.Tensor      # [vocab, hidden]; the embedding itself when tied

    def nbytes(self) -> int:
        seen, total = set(), 0
        for t in self._tensors():
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    def _tensors(self):
        yield self.embed
        yield self.final_norm
        yield self.lm_head
        for layer in self.layers:
            yield from vars(layer).values()


def expected_shapes(cfg: Qwen3Config) -> dict:
    """Every tensor name the checkpoint must hold, with its shape."""
    h, d = cfg.hidden_size, cfg.head_dim
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (cfg.q_size, h),
            p + "self_attn.k_proj.weight": (cfg.kv_size, h),
            p + "self_attn.v_proj.weight": (cfg.kv_size, h),
            p + "self_attn.o_proj.weight": (h, cfg.q_size),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, cfg.intermediate_size),
        })
    return shapes


def _shard_map(model_path: str) -> dict:
    """tensor name -> shard file path, from what the shards actually hold (the
    index only says which files to open: a shard lacking a tensor the index
    promises is then reported as that tensor missing)."""
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map")
        except json.JSONDecodeError as exc:
            raise ValueError(f"{index}: not valid JSON ({exc})") from None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no weight_map")
        shards = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(model_path, "model.safetensors")):
        shards = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{model_path}: no model.safetensors or model.safetensors.index.json")
    out = {}
    for shard in shards:
        path = os.path.join(model_path, shard)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: shard named by the index is missing")
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                out[name] = path
    return out


def load_weights(model_path: str, cfg: Qwen3Config, device: torch.device) -> ModelWeights:
    expected = expected_shapes(cfg)
    shard_of = _shard_map(model_path)
    # A tied checkpoint may still carry lm_head.weight (a copy); it is ignored then.
    present = set(shard_of) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    missing = sorted(set(expected) - present)
    unexpected = sorted(present - set(expected))
    if missing:
        raise ValueError(f"{model_path}: missing tensor {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if unexpected:
        raise ValueError(f"{model_path}: unexpected tensor {unexpected[0]}" + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))

    with ExitStack() as stack:
        # Shards are opened on the CPU (memory-mapped) and each tensor is copied
        # straight into its final, packed place on the device: no device-side
        # temporaries, so the load's peak memory is the weights themselves.
        files = {path: stack.enter_context(safe_open(path, framework="pt")) for path in set(shard_of.values())}

        def read(name: str) -> torch.Tensor:
            t = files[shard_of[name]].get_tensor(name)
            if tuple(t.shape) != expected[name]:
                raise ValueError(f"{shard_of[name]}: tensor {name} has shape {tuple(t.shape)}, config implies {expected[name]}")
            if t.dtype not in _LOADABLE:
                raise ValueError(f"{shard_of[name]}: tensor {name} is {t.dtype}; expected bfloat16, float16 or float32")
            return t

        def place(*names: str) -> torch.Tensor:
            """The named tensors, read and stacked along dim 0 into one BF16 device tensor
            (a float16/float32 tensor is rounded to BF16 by the copy, as the reference's
            from_pretrained(torch_dtype=bfloat16) rounds it)."""
            parts = [read(n) for n in names]
            shape = (sum(t.shape[0] for t in parts),) + tuple(parts[0].shape[1:])
            out = torch.empty(shape, dtype=torch.bfloat16, device=device)
            row = 0
            for t in parts:
                out[row:row + t.shape[0]].copy_(t)
                row += t.shape[0]
            return out

        layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            layers.append(LayerWeights(
                input_norm=place(p + "input_layernorm.weight"),
                qkv=place(p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"),
                q_norm=place(p + "self_attn.q_norm.weight"),
                k_norm=place(p + "self_attn.k_norm.weight"),
                o=place(p + "self_attn.o_proj.weight"),
                post_norm=place(p + "post_attention_layernorm.weight"),
                gate_up=place(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                down=place(p + "mlp.down_proj.weight"),
            ))
        embed = place("model.embed_tokens.weight")
        lm_head = embed if cfg.tie_word_embeddings else place("lm_head.weight")
        return ModelWeights(embed=embed, layers=layers, final_norm=place("model.norm.weight"), lm_head=lm_head)


# ---------------------------------------------------------------------------- Qwen3.5
# The released multimodal checkpoints keep the text model under this prefix and carry
# vision and multi-token-prediction weights the text engine does not run.
_WRAPPED = "model.language_model."
_SKIPPED = ("mtp.", "model.visual.", "visual.")


def load_qwen35_weights(model_dir: str, cfg: Qwen35Config, device: torch.device, pack: bool = True,
                        mtp: bool = False) -> dict:
    """name -> BF16 tensor on the device, text-model names (`model.layers.3.self_attn.q_proj.weight`);
    the released wrapper's prefix is removed, its vision weights skipped (one line), its MTP head
    (`mtp.*`) loaded with mtp (a ValueError where the checkpoint has none), else skipped.
    pack: the model's packed matrices (qwen35_pack_groups: gate | up, a GDN layer's qkv | z | b | a,
    an attention layer's q | k | v) are each read straight into their place in one device tensor,
    so the load's peak is the weights themselves (packing after a load holds both copies)."""
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {model_dir}")
    where, skipped = {}, 0      # text-model name -> (file, stored name)
    for fname in files:
        with safe_open(os.path.join(model_dir, fname), framework="pt") as f:
            for name in f.keys():
                if name.startswith(_SKIPPED) and not (mtp and name.startswith("mtp.")):
                    skipped += 1
                    continue
                where["model." + name[len(_WRAPPED):] if name.startswith(_WRAPPED) else name] = (fname, name)
    if skipped:
        print(f"fastqwen: skipped {skipped} vision / multi-token-prediction tensors", flush=True)
    tied = cfg.tie_word_embeddings or "lm_head.weight" not in where
    missing = [n for n in _expected_names(cfg) if n not in where and not (n == "lm_head.weight" and tied)]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensor(s), e.g. {missing[0]!r}")
    if mtp:
        lacking = [n for n in _mtp_names(cfg) if n not in where]
        if not cfg.mtp_layers or lacking:
            raise ValueError(f"the checkpoint has no complete multi-token-prediction head (mtp_num_hidden_layers "
                             f"{cfg.mtp_layers}" + (f"; {lacking[0]!r} missing)" if lacking else ")"))
    groups = qwen35_pack_groups(cfg, mtp) if pack else {}
    packed_parts = {part for parts in groups.values() for part in parts}
    out = {}
    with ExitStack() as stack:
        handles = {fname: stack.enter_context(safe_open(os.path.join(model_dir, fname), framework="pt"))
                   for fname in files}

        def read(key):
            fname, stored = where[key]
            return handles[fname].get_tensor(stored)

        for key in where:
            if key not in packed_parts and not (key == "lm_head.weight" and tied):
                out[key] = read(key).to(device=device, dtype=torch.bfloat16)
        for packed, parts in groups.items():      # each part read from the shard into its rows
            tensors = [read(part) for part in parts]
            dest = torch.empty((sum(t.shape[0] for t in tensors),) + tuple(tensors[0].shape[1:]),
                               dtype=torch.bfloat16, device=device)
            row = 0
            for t in tensors:
                dest[row:row + t.shape[0]].copy_(t)
                row += t.shape[0]
            out[packed] = dest
    if tied:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def qwen35_pack_groups(cfg: Qwen35Config, mtp: bool = False) -> dict:
    """The packed matrices of a Qwen3.5 model (and with mtp, of its MTP head's layers: q | k | v,
    gate | up): name -> the names stacked into it, in order."""
    groups = {}
    for n in range(cfg.mtp_layers if mtp else 0):
        p = f"mtp.layers.{n}."
        groups[p + "mlp.gate_up.weight"] = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        groups[p + "self_attn.qkv_proj.weight"] = [p + f"self_attn.{x}_proj.weight" for x in "qkv"]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        groups[p + "mlp.gate_up.weight"] = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        if cfg.layer_types[i] == "linear_attention":
            groups[p + "linear_attn.in_proj.weight"] = [p + f"linear_attn.in_proj_{n}.weight"
                                                        for n in ("qkv", "z", "b", "a")]
        else:
            groups[p + "self_attn.qkv_proj.weight"] = [p + f"self_attn.{n}_proj.weight" for n in "qkv"]
    return groups


def _mtp_names(cfg: Qwen35Config) -> list:
    names = ["mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"]
    for n in range(cfg.mtp_layers):
        p = f"mtp.layers.{n}."
        names += [p + "self_attn." + x + ".weight" for x in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
        names += [p + x + ".weight" for x in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
                                               "post_attention_layernorm")]
    return names


def _expected_names(cfg: Qwen35Config) -> list:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        mixer = (["linear_attn." + s for s in ("dt_bias", "A_log", "conv1d.weight", "norm.weight", "out_proj.weight",
                                              "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight",
                                              "in_proj_a.weight")]
                 if kind == "linear_attention" else
                 ["self_attn." + s + ".weight" for s in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")])
        names += [p + s for s in mixer + ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                                           "input_layernorm.weight", "post_attention_layernorm.weight"]]
    return names
