"""Held-out evaluation of a model trained by tools/train_tiny.py (by default the bundled one).

    python tools/eval_tiny.py [--model DIR] [--k 3] [--prompts 32] [--json FILE]

On the held-out standard-library files of the Python running it (the split rule of train_tiny.py:
a hash of each file's path), it reports
  * next-token accuracy and loss, teacher-forced, over up to --tokens held-out tokens;
  * speculative decoding with the MTP head at k drafts: greedy generations from --prompts held-out
    prompts through the real engine (local workers), with the mean acceptance length and the
    acceptance per draft position.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from train_tiny import EOS, is_held_out, stdlib_files

import shardspec
from shardspec.layers.batch import Batch
from shardspec.layers.parallel import TPGroup
from shardspec.models.loader import load_model
from shardspec.orchestrator.tokenizer import Tokenizer

BUNDLED = Path(shardspec.__file__).parent / "bundled"


def held_out_texts() -> list[str]:
    return [p.read_text(encoding="utf-8", errors="replace") for rel, p in stdlib_files() if is_held_out(rel)]


@torch.inference_mode()
def next_token_accuracy(model_dir: Path, texts: list[str], max_tokens: int, window: int = 512) -> dict:
    tokenizer = Tokenizer.from_folder(model_dir)
    eos = tokenizer.inner.token_to_id(EOS)
    stream = []
    for text in texts:
        stream += [*tokenizer.encode(text), eos]
    stream = torch.tensor(stream[: max_tokens + 1])
    model = load_model(model_dir, TPGroup(), torch.float32, torch.device("cpu"), with_mtp=False)
    correct = total = 0
    loss = 0.0
    for start in range(0, len(stream) - 1, window):
        ids = stream[start : start + window + 1]
        logits = model.lm_head.logits(model(ids[None, :-1], Batch.uncached(1, len(ids) - 1, ids.device)))[0]
        correct += int((logits.argmax(-1) == ids[1:]).sum())
        loss += float(F.cross_entropy(logits, ids[1:], reduction="sum"))
        total += len(ids) - 1
    return {"tokens": total, "next_token_accuracy": correct / total, "loss": loss / total}


async def acceptance(model_dir: Path, texts: list[str], k: int, prompts: int, prompt_len: int, new_tokens: int,
                     tp: int) -> dict:
    rng = random.Random(0)
    async with shardspec.connect(model=str(model_dir), local=tp, mtp=True, draft_tokens=k, max_slots=8) as engine:
        pool = [ids for ids in (engine.tokenizer.encode(t) for t in texts) if len(ids) > prompt_len + new_tokens]
        chosen = []
        for _ in range(prompts):
            ids = rng.choice(pool)
            start = rng.randrange(len(ids) - prompt_len - new_tokens)
            chosen.append(ids[start : start + prompt_len])

        async def one(prompt):
            async for chunk in engine.generate(prompt, max_tokens=new_tokens, stop_at_eos=False):
                final = chunk
            return final.stats

        stats = await asyncio.gather(*(one(p) for p in chosen))
    drafts = sum(s["drafts"] for s in stats)
    accepted = sum(s["accepted_tokens"] for s in stats)
    per_position = [sum(s["acceptance_per_position"][j] * s["drafts"] for s in stats) / drafts for j in range(k)]
    return {"k": k, "prompts": prompts, "prompt_tokens": prompt_len, "generated_tokens": new_tokens,
            "drafts": drafts, "mean_acceptance_length": 1 + accepted / drafts,
            "acceptance_per_position": per_position}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=BUNDLED)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=65536, help="held-out tokens for the accuracy")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    texts = held_out_texts()
    result = {"python": sys.version.split()[0], "held_out_files": len(texts)}
    result |= next_token_accuracy(args.model, texts, args.tokens)
    print(json.dumps(result), flush=True)
    result["speculative"] = asyncio.run(
        acceptance(args.model, texts, args.k, args.prompts, args.prompt_len, args.new_tokens, args.tp)
    )
    print(json.dumps(result["speculative"]))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
