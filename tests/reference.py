"""Hugging Face transformers reference for Qwen3.5 text checkpoints (test-only)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import (
    GenerationConfig,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
)

from shardspec.testing.random_checkpoint import text_layout_name


def read_checkpoint(path: str | Path, fuse: bool = True) -> tuple[dict, dict[str, torch.Tensor]]:
    """Text config and text-layout state dict of a checkpoint folder in either layout; `fuse`:
    per-expert tensors stacked as transformers holds them (fuse_experts)."""
    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    config = raw.get("text_config", raw)
    state_dict = {}
    for file in sorted(path.glob("*.safetensors")):
        state_dict |= {text_layout_name(n): t for n, t in load_file(file).items()}
    return config, fuse_experts(state_dict) if fuse else state_dict


def fuse_experts(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors (`mlp.experts.{e}.gate_proj.weight`, ...) stacked into the fused 3-D
    tensors transformers holds (`mlp.experts.gate_up_proj` [E, 2I, H], gate rows first;
    `mlp.experts.down_proj` [E, H, I])."""
    pattern = re.compile(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
    fused: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out = {}
    for name, tensor in state_dict.items():
        match = pattern.fullmatch(name)
        if match is None:
            out[name] = tensor
        else:
            module, e, part = match.groups()
            fused.setdefault(module, {}).setdefault(part, {})[int(e)] = tensor
    for module, parts in fused.items():
        experts = sorted(parts["down_proj"])
        out[f"{module}.gate_up_proj"] = torch.stack(
            [torch.cat([parts["gate_proj"][e], parts["up_proj"][e]]) for e in experts])
        out[f"{module}.down_proj"] = torch.stack([parts["down_proj"][e] for e in experts])
    return out


def hf_model(source: str | Path | tuple[dict, dict[str, torch.Tensor]]) -> Qwen3_5ForCausalLM:
    """fp32 eval-mode transformers model (dense or MoE) from a folder or (text config, text-layout
    state dict)."""
    config, state_dict = read_checkpoint(source) if isinstance(source, (str, Path)) else source
    moe = "num_experts" in config
    config_class, model_class = ((Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM) if moe
                                 else (Qwen3_5TextConfig, Qwen3_5ForCausalLM))
    hf_config = config_class(
        **{k: v for k, v in config.items() if k not in ("architectures", "dtype", "model_type")}
    )
    if moe:
        hf_config._experts_implementation = "eager"  # the plain loop over experts, not a kernel
    model = model_class._from_config(
        hf_config, attn_implementation="eager", dtype=torch.float32
    )
    state_dict = {n: t.float() for n, t in state_dict.items() if not n.startswith("mtp.")}
    if hf_config.tie_word_embeddings:
        state_dict.setdefault("lm_head.weight", state_dict["model.embed_tokens.weight"])
    result = model.load_state_dict(state_dict, strict=True)
    assert not result.missing_keys and not result.unexpected_keys, result
    return model.eval()


@torch.no_grad()
def hf_logits(model: Qwen3_5ForCausalLM, token_ids: list[int]) -> torch.Tensor:
    """Logits [T, vocab] of one full no-cache forward over `token_ids`."""
    return model(input_ids=torch.tensor([token_ids]), use_cache=False).logits[0].float()


@torch.no_grad()
def hf_greedy_with_logits(
    model: Qwen3_5ForCausalLM, prompt_ids: list[int], max_new_tokens: int
) -> tuple[list[int], torch.Tensor]:
    """Greedy decode through the HF cache path; returns new tokens and their logits [N, vocab]."""
    # No eos, so generation cannot stop before max_new_tokens; pad id is unused at batch size 1.
    generation_config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        eos_token_id=None,
        pad_token_id=0,
        bos_token_id=None,
        use_cache=True,
        return_dict_in_generate=True,
        output_logits=True,
    )
    input_ids = torch.tensor([prompt_ids])
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        generation_config=generation_config,
    )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    assert len(tokens) == max_new_tokens, (len(tokens), max_new_tokens)
    return tokens, torch.stack(out.logits, dim=1)[0].float()


def hf_greedy(model: Qwen3_5ForCausalLM, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decode of exactly `max_new_tokens` new tokens through the HF cache path."""
    return hf_greedy_with_logits(model, prompt_ids, max_new_tokens)[0]
