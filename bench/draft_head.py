"""What an fp8 draft head costs in acceptance: MTP decoding of held-out text with the bundled model,
the drafts read from its LM head as stored and from an fp8 copy (e4m3, a scale per row).

    python bench/draft_head.py [--prompts 16] [--tokens 64] [--k 3]

Greedy, in-process, on the CPU: the fp8 head is emulated by argmax over the dequantized weight,
the same numbers shardspec.kernels.head computes on a GPU up to the summation order. The output
does not change (the target's verify pass decides it; checked here too); the acceptance may.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tools"))
from train_tiny import is_held_out, stdlib_files

from shardspec.cli import BUNDLED_MODEL
from shardspec.kernels.head import quantize_rows
from shardspec.layers.parallel import TPGroup
from shardspec.models.loader import load_model
from shardspec.orchestrator.tokenizer import Tokenizer
from shardspec.protocol.messages import PrefillSpec, StepRequest
from shardspec.shard_worker.decoder import Decoder
from shardspec.testing.grants import Grants


def prompts(count: int, length: int) -> list[list[int]]:
    tokenizer = Tokenizer.from_folder(BUNDLED_MODEL)
    files = [p for rel, p in stdlib_files() if is_held_out(rel)][:count]
    return [tokenizer.encode(p.read_text(errors="replace"))[:length] for p in files]


@torch.inference_mode()
def decode(model, texts: list[list[int]], tokens: int, k: int) -> tuple[list[list[int]], float]:
    """Greedy MTP decoding of each prompt alone: (outputs, mean acceptance length)."""
    runner = Decoder(model, torch.device("cpu"), 1, 512, 512, k)
    grants = Grants(runner)
    outputs = []
    for text in texts:
        out = grants.step(StepRequest(prefill=[PrefillSpec(seq=0, length=len(text), max_tokens=tokens)]),
                          torch.tensor(text)).tokens[0]
        while not runner.sequences[0].finished:
            out += runner.step(StepRequest(decode=[0]), torch.empty(0, dtype=torch.long)).tokens[0]
        grants.release([0])
        outputs.append(out)
    c = runner.counters
    runner.close()
    return outputs, 1 + c.accepted_tokens / c.drafts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=3)
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    model = load_model(BUNDLED_MODEL, TPGroup(), torch.float32, torch.device("cpu"), with_mtp=True)
    texts = prompts(args.prompts, args.prompt_tokens)
    plain, plain_mal = decode(model, texts, args.tokens, args.k)
    w8, scale = quantize_rows(model.lm_head.weight)
    dense = w8.float() * scale[:, None]
    lm_head = model.lm_head
    lm_head.draft_argmax = lambda h: (h.float() @ dense.T)[..., : lm_head.vocab_size].argmax(-1)
    fp8, fp8_mal = decode(model, texts, args.tokens, args.k)
    print(f"{len(texts)} held-out prompts of {args.prompt_tokens} tokens, {args.tokens} new tokens, k = {args.k}")
    print(f"mean acceptance length: head as stored {plain_mal:.3f}, fp8 head {fp8_mal:.3f} "
          f"({fp8_mal / plain_mal - 1:+.1%}); outputs equal: {plain == fp8}")


if __name__ == "__main__":
    main()
