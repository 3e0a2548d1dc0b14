"""Teacher-forced top-1 agreement of a block-wise FP8 checkpoint, on one GPU: with its own exact
reference (our implementation) and with its bf16 twin (the quantisation), overall and where the
reference is confident beyond the measured noise.

    python bench/fp8_agreement.py --bf16 .bench/9b --fp8 .bench/9b-fp8 --prompts 16 --tokens 128 --out agreement.json

Each prompt is 16 random tokens followed by the bf16 model's greedy continuation of --tokens
tokens; every model then reads the same sequences, and at each continuation position its logits
are set against a reference's. The FP8 model runs as served (bf16 activations, FP8 weights in
memory) through one prefill pass over all positions (the W8A8 GEMMs) and through one-token decode
passes (the weight-only GEMMs). References:
- exact: the same FP8 checkpoint in fp32 (weights exactly W8 · scale, fp32 activations): what the
  FP8 path should compute; a gap here is ours (the bf16 activations, the W8A8 rounding, kernels);
- bf16: the bf16 twin the FP8 checkpoint was quantised from (the issue's agreement criterion), as
  served (prefill and decode, bf16).
Agreement is reported overall and at the reference's confident positions (shardspec.testing.agreement).
Printed and written to --out as JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from shardspec.layers.batch import Batch
from shardspec.layers.parallel import TPGroup
from shardspec.models.loader import load_model
from shardspec.testing.agreement import CONFIDENT_SIGMAS, top1_agreement

PROMPT = 16


def load(folder: Path, device: torch.device, dtype: torch.dtype = torch.bfloat16):
    return load_model(folder, TPGroup(), dtype, device, with_mtp=False)


def decode_logits(model, ids: torch.Tensor, span: slice, dtype: torch.dtype) -> torch.Tensor:
    """Logits after each token of ids [B, T] in span, through one-token cached passes (fp32)."""
    B, T = ids.shape
    slots = torch.arange(B, device=ids.device)
    positions = torch.arange(T, device=ids.device).expand(B, -1)
    model.allocate_caches(B, T, dtype, ids.device)
    model.reset_slots(slots)
    hidden = torch.cat([model(ids[:, t : t + 1], Batch(slots, positions[:, t : t + 1], t + 1)) for t in range(T)], 1)
    return model.lm_head.logits(hidden[:, span]).float()


def prefill_logits(model, ids: torch.Tensor, span: slice) -> torch.Tensor:
    """Logits after each token of ids [B, T] in span, through one uncached pass (fp32)."""
    B, T = ids.shape
    return model.lm_head.logits(model(ids, Batch.uncached(B, T, ids.device))[:, span]).float()


def report(name: str, result: dict) -> None:
    confident = result["confident_top1_agreement"]
    print(f"{name}: top-1 agreement {result['top1_agreement']:.2%}; at the {result['confident_share']:.1%} of "
          f"positions with margin > {CONFIDENT_SIGMAS:.2f} σ: {'-' if confident is None else f'{confident:.2%}'}; "
          f"noise σ = {result['noise_over_logit_std']:.3f} of the logits' std", flush=True)


def continuation(model, prompts: int, tokens: int, device: torch.device) -> torch.Tensor:
    """16 random tokens per prompt and the model's greedy continuation of `tokens` tokens."""
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (prompts, PROMPT), generator=torch.Generator().manual_seed(0)).to(device)
    for _ in range(tokens):
        ids = torch.cat([ids, prefill_logits(model, ids, slice(-1, None)).argmax(-1)], 1)
    return ids


def free(model) -> None:
    del model
    torch.cuda.empty_cache()


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bf16", type=Path, required=True)
    parser.add_argument("--fp8", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("fp8-agreement.json"))
    parser.add_argument("--device", default="cuda", help="the GPU to run on: cuda or cuda:N (default cuda)")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.cuda.set_device(device)  # (Triton launches on the current device)
    span = slice(PROMPT - 1, PROMPT - 1 + args.tokens)  # the predictions of the continuation's tokens

    model = load(args.bf16, device)
    ids = continuation(model, args.prompts, args.tokens, device)
    bf16 = {"prefill": prefill_logits(model, ids, span), "decode": decode_logits(model, ids, span, torch.bfloat16)}
    free(model)
    model = load(args.fp8, device, torch.float32)
    exact = prefill_logits(model, ids, span)
    free(model)
    model = load(args.fp8, device)
    fp8 = {"prefill": prefill_logits(model, ids, span), "decode": decode_logits(model, ids, span, torch.bfloat16)}
    free(model)

    result = {"bf16": str(args.bf16), "fp8": str(args.fp8), "prompts": args.prompts, "tokens": args.tokens,
              "device": torch.cuda.get_device_name(device), "confident_sigmas": CONFIDENT_SIGMAS}
    for path in ("prefill", "decode"):
        for reference_name, reference in (("exact", exact), ("bf16", bf16[path])):
            result[f"{path}_vs_{reference_name}"] = top1_agreement(fp8[path], reference)
            report(f"FP8 {path} vs {reference_name}", result[f"{path}_vs_{reference_name}"])
    result["bf16_decode_vs_bf16_prefill"] = top1_agreement(bf16["decode"], bf16["prefill"])  # the bf16 paths' own noise
    report("bf16 decode vs bf16 prefill", result["bf16_decode_vs_bf16_prefill"])
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
