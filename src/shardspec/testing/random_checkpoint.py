"""Random-weight Qwen3.5 (dense and mixture-of-experts, text) checkpoints in Hugging Face folder format."""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

LAYOUTS = ("model", "language_model")
# routed experts: fused 3-D tensors, one tensor per expert, or fused in the layers and per expert in
# the MTP layer (as Qwen3.5-35B-A3B is released)
EXPERT_LAYOUTS = ("fused", "per_expert", "mixed")
# lm_head std = LOGIT_GAIN / sqrt(hidden), so logits ~ N(0, LOGIT_GAIN²): peaked, not saturated
LOGIT_GAIN = 3.0
KEEP_LIMIT_BYTES = 1 << 30  # write_random_checkpoint keeps tensors by default only below this
PROGRESS_MIN_BYTES = 1 << 30  # report write progress on stderr from this checkpoint size up

_ST_DTYPES = {
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _layer_types(num_layers: int, interval: int = 4) -> list[str]:
    """Qwen3.5 hybrid pattern: every `interval`-th layer is full attention."""
    return [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(num_layers)
    ]


def tiny_config(**overrides) -> dict:
    """Small Qwen3.5 text config: head counts divide by 1, 2 and 4; GQA and grouped GDN heads."""
    config = {
        "model_type": "qwen3_5_text",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "layer_types": _layer_types(4),
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 16,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "dtype": "float32",
        "mtp_num_hidden_layers": 1,
    }
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        overrides = {**overrides, "layer_types": _layer_types(overrides["num_hidden_layers"])}
    config.update(overrides)
    return config


# Shapes from the text_config of the public Hugging Face config.json files of Qwen/Qwen3.5-9B,
# Qwen/Qwen3.5-27B and Qwen/Qwen3.5-35B-A3B; the 9B values are also transformers 5.24's
# Qwen3_5TextConfig defaults. What the released sizes share:
RELEASE_SHAPES = dict(
    vocab_size=248320,
    head_dim=256,
    linear_num_key_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    max_position_embeddings=262144,
    eos_token_id=248044,
    dtype="bfloat16",
)


def nine_b_config() -> dict:
    """Qwen3.5-9B text shapes."""
    return tiny_config(**RELEASE_SHAPES, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                       num_attention_heads=16, num_key_value_heads=4, linear_num_value_heads=32)


def twenty_seven_b_config() -> dict:
    """Qwen3.5-27B text shapes."""
    return tiny_config(**RELEASE_SHAPES, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                       num_attention_heads=24, num_key_value_heads=4, linear_num_value_heads=48)


def tiny_moe_config(**overrides) -> dict:
    """The tiny config with a mixture of experts in every MLP: 8 experts, top 3; widths that divide
    by 1, 2 and 4 (and stay multiples of 8 per rank, as grouped matmuls need)."""
    config = tiny_config(model_type="qwen3_5_moe_text", num_experts=8, num_experts_per_tok=3,
                         moe_intermediate_size=32, shared_expert_intermediate_size=48)
    del config["intermediate_size"]
    config.update(overrides)
    return config


def thirty_five_b_a3b_config() -> dict:
    """Qwen3.5-35B-A3B text shapes (hidden 2048, 40 layers, 256 experts, top 8, widths 512)."""
    return tiny_moe_config(**RELEASE_SHAPES, hidden_size=2048, num_hidden_layers=40, layer_types=_layer_types(40),
                           num_attention_heads=16, num_key_value_heads=2, linear_num_value_heads=32,
                           num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                           shared_expert_intermediate_size=512)


def _mlp_shapes(prefix: str, c: dict, per_expert: bool) -> dict[str, tuple[int, ...]]:
    """A layer's MLP under `prefix` ('model.layers.3.mlp.'): dense, or the sparse MoE block."""
    h = c["hidden_size"]
    if "num_experts" not in c:
        i = c["intermediate_size"]
        return {f"{prefix}gate_proj.weight": (i, h), f"{prefix}up_proj.weight": (i, h),
                f"{prefix}down_proj.weight": (h, i)}
    n, i, s = c["num_experts"], c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {f"{prefix}gate.weight": (n, h)}
    if per_expert:
        for e in range(n):
            shapes |= {f"{prefix}experts.{e}.gate_proj.weight": (i, h), f"{prefix}experts.{e}.up_proj.weight": (i, h),
                       f"{prefix}experts.{e}.down_proj.weight": (h, i)}
    else:
        shapes |= {f"{prefix}experts.gate_up_proj": (n, 2 * i, h), f"{prefix}experts.down_proj": (n, h, i)}
    return shapes | {
        f"{prefix}shared_expert.gate_proj.weight": (s, h),
        f"{prefix}shared_expert.up_proj.weight": (s, h),
        f"{prefix}shared_expert.down_proj.weight": (h, s),
        f"{prefix}shared_expert_gate.weight": (1, h),
    }


def _decoder_layer_shapes(
    prefix: str, c: dict, layer_type: str, per_expert: bool = False
) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of one decoder layer under `prefix` (e.g. 'model.layers.3.')."""
    h = c["hidden_size"]
    shapes: dict[str, tuple[int, ...]] = {f"{prefix}input_layernorm.weight": (h,)}
    if layer_type == "linear_attention":
        nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
        dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
        conv_dim = 2 * nk * dk + nv * dv
        a = f"{prefix}linear_attn."
        shapes |= {
            f"{a}in_proj_qkv.weight": (conv_dim, h),
            f"{a}in_proj_z.weight": (nv * dv, h),
            f"{a}in_proj_b.weight": (nv, h),
            f"{a}in_proj_a.weight": (nv, h),
            f"{a}conv1d.weight": (conv_dim, 1, c["linear_conv_kernel_dim"]),
            f"{a}dt_bias": (nv,),
            f"{a}A_log": (nv,),
            f"{a}norm.weight": (dv,),
            f"{a}out_proj.weight": (h, nv * dv),
        }
    elif layer_type == "full_attention":
        nq, nkv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        a = f"{prefix}self_attn."
        shapes |= {
            f"{a}q_proj.weight": (2 * nq * d, h),  # per head: [query | output gate]
            f"{a}k_proj.weight": (nkv * d, h),
            f"{a}v_proj.weight": (nkv * d, h),
            f"{a}o_proj.weight": (h, nq * d),
            f"{a}q_norm.weight": (d,),
            f"{a}k_norm.weight": (d,),
        }
    else:
        raise ValueError(f"unknown layer type {layer_type!r}")
    shapes[f"{prefix}post_attention_layernorm.weight"] = (h,)
    return shapes | _mlp_shapes(f"{prefix}mlp.", c, per_expert)


def parameter_shapes(config: dict, mtp: bool = True, experts: str = "fused") -> dict[str, tuple[int, ...]]:
    """Ordered text-layout parameter names and shapes of a Qwen3.5 text checkpoint; `experts`: the
    routed experts' layout (EXPERT_LAYOUTS) of an MoE config."""
    if experts not in EXPERT_LAYOUTS:
        raise ValueError(f"experts must be one of {EXPERT_LAYOUTS}, got {experts!r}")
    h = config["hidden_size"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], h)}
    for i, layer_type in enumerate(config["layer_types"][: config["num_hidden_layers"]]):
        shapes |= _decoder_layer_shapes(f"model.layers.{i}.", config, layer_type, experts == "per_expert")
    shapes["model.norm.weight"] = (h,)
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (config["vocab_size"], h)
    if mtp:
        shapes |= {
            "mtp.fc.weight": (h, 2 * h),
            "mtp.pre_fc_norm_embedding.weight": (h,),
            "mtp.pre_fc_norm_hidden.weight": (h,),
        }
        for j in range(config.get("mtp_num_hidden_layers", 1)):
            shapes |= _decoder_layer_shapes(f"mtp.layers.{j}.", config, "full_attention", experts != "fused")
        shapes["mtp.norm.weight"] = (h,)
    return shapes


def _generator(seed: int, name: str) -> torch.Generator:
    """Per-tensor generator, so values depend only on (seed, name), not on order or sharding."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def random_tensor(
    config: dict, name: str, shape: tuple[int, ...], seed: int, dtype=torch.float32
) -> Tensor:
    """One randomly initialised parameter, chosen by its (text-layout) name."""
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return _fused_experts(config, name, shape, seed, dtype)
    g = _generator(seed, name)
    module = name.split(".")[-2]

    def randn() -> Tensor:
        return torch.randn(shape, generator=g)

    # In-place ops keep the peak at one fp32 copy (+ the cast) for vocab-sized tensors.
    if name == "model.embed_tokens.weight":
        t = randn()
    elif name == "lm_head.weight":
        t = randn().mul_(LOGIT_GAIN / math.sqrt(shape[1]))
    elif name.endswith("linear_attn.norm.weight"):
        t = randn().mul_(0.2).add_(1.0)  # gated RMSNorm multiplies by w directly
    elif "norm" in module:
        t = randn().mul_(0.2)  # zero-centred RMSNorm: x̂ * (1 + w)
    elif name.endswith("A_log"):
        t = torch.empty(shape).uniform_(0.5, 8.0, generator=g).log_()
    elif name.endswith("dt_bias"):
        t = randn().mul_(0.5)
    elif name.endswith("conv1d.weight"):
        t = randn().mul_(0.3)
    elif len(shape) == 2:
        t = randn().mul_(1.0 / math.sqrt(shape[1]))
    else:
        raise ValueError(f"no init rule for {name}")
    return t.to(dtype)


def _fused_experts(config: dict, name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> Tensor:
    """A fused 3-D expert tensor made of the per-expert tensors random_tensor gives: a checkpoint has
    the same weights in either expert layout."""
    module, leaf = name.rsplit(".", 1)
    parts = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",)
    out = torch.empty(shape, dtype=dtype)
    rows = shape[1] // len(parts)
    for e in range(shape[0]):
        for j, part in enumerate(parts):
            out[e, j * rows : (j + 1) * rows] = random_tensor(config, f"{module}.{e}.{part}.weight",
                                                              (rows, shape[2]), seed, dtype)
    return out


def random_state_dict(
    config: dict, seed: int, dtype=torch.float32, mtp: bool = True, experts: str = "fused"
) -> dict[str, Tensor]:
    """Deterministic random text-layout state dict for `config`."""
    return {
        n: random_tensor(config, n, s, seed, dtype)
        for n, s in parameter_shapes(config, mtp, experts).items()
    }


# What the FP8 releases leave unquantised among the 2-D weights (docs/architecture.md, "FP8 checkpoints")
FP8_KEEP = ("embed_tokens", "lm_head", "in_proj_a", "in_proj_b", "mtp.fc", "mlp.gate.", "shared_expert_gate")
FP8_BLOCK, FP8_MAX = 128, 448.0


def fp8_quantized(name: str, shape: tuple[int, ...]) -> bool:
    """Whether an FP8 release stores this text-layout tensor as FP8 (with a weight_scale_inv)."""
    return name.endswith(".weight") and len(shape) == 2 and not any(part in name for part in FP8_KEEP)


def quantize_fp8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """weight [N, K] -> (e4m3 [N, K], fp32 scales [⌈N/128⌉, ⌈K/128⌉]) with weight ≈ w8 · scale per
    128 × 128 block, each block's largest magnitude mapped to e4m3's largest (448)."""
    n, k = weight.shape
    nb, kb = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    tiles = weight.new_zeros(nb * FP8_BLOCK, kb * FP8_BLOCK, dtype=torch.float32)
    tiles[:n, :k] = weight
    tiles = tiles.view(nb, FP8_BLOCK, kb, FP8_BLOCK)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    w8 = tiles.div_(scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return w8.view(nb * FP8_BLOCK, kb * FP8_BLOCK)[:n, :k].contiguous(), scale


def fp8_config(config: dict, layout: str) -> dict:
    """`config` with the quantization_config of an FP8 release in `layout`."""
    keep = sorted({layout_name(n, layout).removesuffix(".weight") for n, shape in parameter_shapes(config).items()
                   if len(shape) == 2 and not fp8_quantized(n, shape)})
    return {**config, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                              "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
                                              "modules_to_not_convert": keep}}


class _Quantizer:
    """Each weight quantised once, whichever of it and its scale a writer thread asks for first;
    forgotten once both are taken."""

    def __init__(self, make: Callable[[str], Tensor]):
        self.make, self.lock, self.slots = make, threading.Lock(), {}

    def get(self, name: str, part: int) -> Tensor:
        """Part 0 (the FP8 weight) or 1 (its scales) of weight `name`."""
        with self.lock:
            slot = self.slots.setdefault(name, [threading.Lock(), None, 2])
        with slot[0]:
            if slot[1] is None:
                slot[1] = quantize_fp8(self.make(name))
            value = slot[1][part]
            slot[2] -= 1
        if not slot[2]:
            with self.lock:
                self.slots.pop(name, None)
        return value


def layout_name(name: str, layout: str) -> str:
    """Rename a text-layout parameter name for a checkpoint layout."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "language_model" and name.startswith("model."):
        return "model.language_model." + name.removeprefix("model.")
    return name


def text_layout_name(name: str) -> str:
    """Undo `layout_name`: map a checkpoint name of either layout to the text layout."""
    if name.startswith("model.language_model."):
        return "model." + name.removeprefix("model.language_model.")
    return name


def checkpoint_config(config: dict, layout: str) -> dict:
    """The config.json contents for a text config written in `layout`."""
    text = {k: v for k, v in config.items() if k not in ("architectures", "quantization_config")}
    top = {"quantization_config": config["quantization_config"]} if "quantization_config" in config else {}
    moe = "Moe" if "num_experts" in config else ""
    if layout == "model":
        return {**text, "architectures": [f"Qwen3_5{moe}ForCausalLM"], **top}
    if layout == "language_model":
        return {
            "model_type": "qwen3_5_moe" if moe else "qwen3_5",
            "architectures": [f"Qwen3_5{moe}ForConditionalGeneration"],
            "text_config": text,
            "tie_word_embeddings": text.get("tie_word_embeddings", False),
            **top,
        }
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _split(sizes: list[int], shards: int) -> list[int]:
    """Shard index of each tensor: contiguous groups of roughly equal byte size."""
    if not 1 <= shards <= len(sizes):
        raise ValueError(f"shards must be in [1, {len(sizes)}], got {shards}")
    total, done, shard, out = sum(sizes), 0, 0, []
    for i, size in enumerate(sizes):
        target = min(done * shards // total, shard + 1, shards - 1)
        # but leave at least one tensor for every later shard
        shard = max(shard, target, shards - (len(sizes) - i))
        out.append(shard)
        done += size
    return out


def _write_safetensors(
    file: Path,
    entries: list[tuple[str, tuple[int, ...], torch.dtype]],
    get: Callable[[], Iterator[Tensor | None]],
    progress: Callable[[int], None],
) -> None:
    """Stream tensors into a safetensors file in the order `get` yields them; None leaves a hole (the
    tensor reads as zeros and takes no disk space)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in entries:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": _ST_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for (name, shape, dtype), tensor in zip(entries, get(), strict=True):
            if tensor is None:
                f.seek(math.prod(shape) * dtype.itemsize, os.SEEK_CUR)
                continue
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise ValueError(
                    f"{name}: expected {shape} {dtype}, got {tuple(tensor.shape)} {tensor.dtype}"
                )
            f.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
            progress(tensor.numel() * dtype.itemsize)
        f.truncate()  # a hole at the end still counts in the file's length


def _write(
    path: str | Path,
    config: dict,
    entries: list[tuple[str, tuple[int, ...], torch.dtype]],
    tensor_of: Callable[[str], Tensor | None],
    layout: str,
    shards: int,
) -> None:
    """Write config.json and weights; `entries` are text-layout (name, shape, dtype) triples."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sizes = [math.prod(s) * d.itemsize for _, s, d in entries]
    total = sum(sizes)
    shard_of = _split(sizes, shards)
    files = (
        ["model.safetensors"]
        if shards == 1
        else [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    )
    verbose, written, reported = total >= PROGRESS_MIN_BYTES, 0, 0

    def progress(nbytes: int) -> None:
        nonlocal written, reported
        written += nbytes
        if verbose and (written - reported >= total // 50 or written == total):
            reported = written
            print(
                f"random_checkpoint: {written / 2**30:.1f}/{total / 2**30:.1f} GiB -> {path}",
                file=sys.stderr,
                flush=True,
            )

    weight_map = {}
    for k, file in enumerate(files):
        group = [e for e, s in zip(entries, shard_of, strict=True) if s == k]
        named = [(layout_name(n, layout), shape, dtype) for n, shape, dtype in group]
        _write_safetensors(
            path / file, named, lambda g=group: _ahead(tensor_of, [n for n, _, _ in g]), progress
        )
        weight_map |= {n: file for n, _, _ in named}
    if shards > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    # last: a folder with config.json is complete (a write cut short leaves none)
    (path / "config.json").write_text(json.dumps(checkpoint_config(config, layout), indent=2) + "\n")


def _ahead(make: Callable[[str], Tensor | None], names: Iterable[str]) -> Iterator[Tensor | None]:
    """make(name) for each name, in order, computed a few at a time on threads (torch's CPU ops
    release the GIL) while the caller writes the earlier ones: random 27B weights take minutes on
    one core."""
    workers = min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(workers) as pool:
        pending: deque = deque()
        for name in names:
            pending.append(pool.submit(make, name))
            if len(pending) > workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def write_checkpoint(
    path: str | Path,
    config: dict,
    state_dict: dict[str, Tensor],
    layout: str = "model",
    shards: int = 1,
) -> None:
    """Write a text-layout state dict and its config as a Hugging Face checkpoint folder."""
    entries = [(n, tuple(t.shape), t.dtype) for n, t in state_dict.items()]
    _write(path, config, entries, state_dict.__getitem__, layout, shards)


def write_random_checkpoint(
    path: str | Path,
    config: dict | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    layout: str = "model",
    shards: int = 1,
    mtp: bool = True,
    keep: bool | None = None,
    fp8: bool = False,
    experts: str = "fused",
    zero_experts: bool = False,
) -> dict[str, Tensor]:
    """Stream a random checkpoint to `path`; returns its text-layout state dict, or {} if not kept.
    `experts`: the routed experts' layout of an MoE config (EXPERT_LAYOUTS). `zero_experts`: the
    routed experts are zeros, written as holes (benchmarks on small disks: 35B-A3B's experts are
    64 of its 70 GB; a step's speed does not depend on their values, and routing, which does,
    stays random); every other tensor is random.

    Tensors are generated a few at a time while writing, so peak memory is a few tensors plus what
    is kept; `keep=None` keeps (and returns) the state dict only below KEEP_LIMIT_BYTES. fp8: in an
    FP8 release's format, quantised from the `dtype` checkpoint of the same seed (fp8_quantized).
    """
    config = dict(tiny_config() if config is None else config)
    config["dtype"] = str(dtype).removeprefix("torch.")
    shapes = parameter_shapes(config, mtp, experts)
    entries = [(n, s, dtype) for n, s in shapes.items()]
    if fp8:
        config = fp8_config(config, layout)
        entries = _fp8_entries(entries)
    if keep is None:
        keep = sum(math.prod(s) * d.itemsize for _, s, d in entries) < KEEP_LIMIT_BYTES
    kept: dict[str, Tensor] = {}
    written = {n: (s, d) for n, s, d in entries}  # FP8 weights and their scales included
    quantizer = _Quantizer(lambda name: random_tensor(config, name, shapes[name], seed, dtype))

    def tensor_of(name: str) -> Tensor | None:
        if zero_experts and ".experts." in name:
            if keep:
                kept[name] = torch.zeros(written[name][0], dtype=written[name][1])
            return None
        if name.endswith("_scale_inv"):
            t = quantizer.get(name.removesuffix("_scale_inv"), 1)
        elif fp8 and fp8_quantized(name, shapes[name]):
            t = quantizer.get(name, 0)
        else:
            t = random_tensor(config, name, shapes[name], seed, dtype)
        if keep:
            kept[name] = t
        return t

    _write(path, config, entries, tensor_of, layout, shards)
    return {n: kept[n] for n, _, _ in entries} if keep else {}


def _fp8_entries(entries: list[tuple[str, tuple[int, ...], torch.dtype]]) -> list:
    """The (name, shape, dtype) entries of the FP8 form: each quantised weight as e4m3, followed
    by its fp32 weight_scale_inv."""
    out = []
    for name, shape, dtype in entries:
        if not fp8_quantized(name, shape):
            out.append((name, shape, dtype))
            continue
        blocks = tuple(-(-n // FP8_BLOCK) for n in shape)
        out += [(name, shape, torch.float8_e4m3fn), (name + "_scale_inv", blocks, torch.float32)]
    return out


def main(argv: list[str] | None = None) -> None:
    """`python -m shardspec.testing.random_checkpoint DIR`: write a random-weight checkpoint."""
    import argparse

    sizes = {"tiny": tiny_config, "9b": nine_b_config, "27b": twenty_seven_b_config, "tiny-moe": tiny_moe_config,
             "35b-a3b": thirty_five_b_a3b_config}
    parser = argparse.ArgumentParser(description="Write a random-weight Qwen3.5 checkpoint folder.")
    parser.add_argument("path", type=Path)
    parser.add_argument("--size", choices=sizes, default="tiny")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="default: float32 for the tiny sizes, bfloat16 otherwise")
    parser.add_argument("--layout", choices=LAYOUTS, default="model")
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-mtp", action="store_true", help="leave out the mtp.* weights")
    parser.add_argument("--fp8", action="store_true",
                        help="block-wise FP8 (e4m3, 128 × 128 scales) as the FP8 releases, quantised from the "
                             "--dtype checkpoint of the same seed; unquantised tensors in --dtype")
    parser.add_argument("--experts", choices=EXPERT_LAYOUTS, default="mixed",
                        help="MoE sizes: routed experts as fused 3-D tensors, one tensor per expert, or mixed (fused "
                             "in the layers, per expert in the MTP layer, as Qwen3.5-35B-A3B is released)")
    parser.add_argument("--zero-experts", action="store_true",
                        help="MoE sizes, for benchmarks on small disks: routed experts all zeros, written as holes of "
                             "sparse files (35B-A3B: ~6 GB on disk instead of 70); every other tensor random")
    args = parser.parse_args(argv)
    config = sizes[args.size]()
    if args.zero_experts and "num_experts" not in config:
        moe = ", ".join(size for size, make in sizes.items() if "num_experts" in make())
        parser.error(f"--zero-experts applies to the MoE sizes ({moe}), not {args.size}")
    dtype = getattr(torch, args.dtype or ("float32" if args.size.startswith("tiny") else "bfloat16"))
    try:
        write_random_checkpoint(args.path, config, seed=args.seed, dtype=dtype, layout=args.layout,
                                shards=args.shards, mtp=not args.no_mtp, keep=False, fp8=args.fp8,
                                experts=args.experts, zero_experts=args.zero_experts)
    except ValueError as exc:  # a --shards count the checkpoint's tensors cannot fill
        parser.error(str(exc))
    kind = "FP8 " if args.fp8 else ""
    print(f"wrote a random {kind}{args.size} checkpoint to {args.path}", file=sys.stderr)


if __name__ == "__main__":
    main()
