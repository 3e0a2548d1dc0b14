"""Teacher-forced top-1 agreement of a block-wise FP8 checkpoint with its bf16 twin, on one GPU.

    python bench/fp8_agreement.py --bf16 .bench/9b --fp8 .bench/9b-fp8 --prompts 16 --tokens 128 --out agreement.json

Both models loaded in-process (bf16 activations, the FP8 weights kept FP8). Each of the prompts is
16 random tokens followed by the bf16 model's greedy continuation of --tokens tokens; both models
then read the same sequences, and at each continuation position the FP8 model's argmax is set
against the bf16 model's: through one prefill pass over all of them (the W8A8 GEMMs) and through
one-token decode passes (the weight-only GEMMs). Printed and written to --out as JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from shardspec.layers.batch import Batch
from shardspec.layers.parallel import TPGroup
from shardspec.models.loader import load_model

PROMPT = 16


def load(folder: Path):
    return load_model(folder, TPGroup(), torch.bfloat16, torch.device("cuda"), with_mtp=False)


def decode_argmax(model, ids: torch.Tensor) -> torch.Tensor:
    """Argmax after each token of ids [B, T], through one-token cached passes."""
    B, T = ids.shape
    slots = torch.arange(B, device=ids.device)
    positions = torch.arange(T, device=ids.device).expand(B, -1)
    model.allocate_caches(B, T, torch.bfloat16, ids.device)
    model.reset_slots(slots)
    return torch.cat([model.lm_head.argmax(model(ids[:, t : t + 1], Batch(slots, positions[:, t : t + 1], t + 1)))
                      for t in range(T)], 1)


def prefill_argmax(model, ids: torch.Tensor, last: bool = False) -> torch.Tensor:
    """Argmax after each token of ids [B, T] (last: after the last only), through one pass."""
    B, T = ids.shape
    hidden = model(ids, Batch.uncached(B, T, ids.device))
    return model.lm_head.argmax(hidden[:, -1:] if last else hidden)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bf16", type=Path, required=True)
    parser.add_argument("--fp8", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("fp8-agreement.json"))
    args = parser.parse_args()

    bf16 = load(args.bf16)
    vocab = bf16.config.vocab_size
    ids = torch.randint(0, vocab, (args.prompts, PROMPT), generator=torch.Generator().manual_seed(0)).cuda()
    for _ in range(args.tokens):  # the bf16 model's greedy continuation: sequences it finds likely
        ids = torch.cat([ids, prefill_argmax(bf16, ids, last=True)], 1)
    reference = {"prefill": prefill_argmax(bf16, ids), "decode": decode_argmax(bf16, ids)}
    del bf16
    torch.cuda.empty_cache()
    fp8 = load(args.fp8)
    got = {"prefill": prefill_argmax(fp8, ids), "decode": decode_argmax(fp8, ids)}
    span = slice(PROMPT - 1, PROMPT - 1 + args.tokens)  # the predictions of the continuation's tokens
    result = {"bf16": str(args.bf16), "fp8": str(args.fp8), "prompts": args.prompts, "tokens": args.tokens,
              "device": torch.cuda.get_device_name()}
    for path in ("prefill", "decode"):
        result[f"{path}_top1_agreement"] = (got[path][:, span] == reference[path][:, span]).float().mean().item()
        print(f"{path}: FP8 top-1 = bf16 top-1 at {result[f'{path}_top1_agreement']:.2%} of "
              f"{args.prompts} × {args.tokens} positions", flush=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
