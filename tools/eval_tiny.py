"""Held-out evaluation of a model trained by tools/train_tiny.py (by default the bundled one).

    python tools/eval_tiny.py [--model DIR] [--k 3] [--prompts 32] [--json FILE]

On the held-out standard-library files of the Python running it (the split rule of train_tiny.py:
a hash of each file's path), it reports
  * next-token accuracy and loss, teacher-forced, over up to --tokens held-out tokens;
  * speculative decoding with the MTP head at k drafts: greedy generations from --prompts held-out
    prompts through the real engine (local workers), with the mean acceptance length and the
    acceptance per draft position;
  * the quality of what the main job writes: the bodies it samples, at `shardspec generate`'s
    defaults (2 local workers, MTP on, its temperature, top-k, top-p and token limit, seed i for
    signature i), for --signatures function signatures drawn from the held-out files; each body cut
    at its last complete statement must parse with `ast` (parse rate), and no line may repeat 3
    times in a row (no-repeat rate). One request at a time, as the main job runs.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import io
import json
import random
import shlex
import statistics
import sys
import textwrap
import tokenize
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from train_tiny import EOS, is_held_out, stdlib_files

import shardspec
from shardspec.cli import build_parser, sampling_penalties
from shardspec.layers.batch import Batch
from shardspec.layers.parallel import TPGroup
from shardspec.models.loader import load_model
from shardspec.orchestrator.tokenizer import Tokenizer

BUNDLED = Path(shardspec.__file__).parent / "bundled"
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
STATEMENT_END = (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)  # what a statement's first token follows
EVAL_SIGNATURES = 32  # the quality check's signatures (--signatures' default)


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
    async with shardspec.connect(model=str(model_dir), local=tp, mtp=True, draft_tokens=k, max_seqs=8) as engine:
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


def held_out_signatures(texts: list[str], count: int, seed: int, dev: bool = False) -> list[str]:
    """`count` distinct prompts drawn with a seeded generator from the held-out files' functions and
    methods (see signatures), each ending at the def's colon (a byte-level BPE writes the newline
    and the body's indentation as one token: a prompt ending in a bare newline is one it never saw).
    dev: drawn with seed + 1 from those the evaluation's draw (EVAL_SIGNATURES at `seed`) leaves out:
    a set to choose sampling defaults on without touching the evaluation's."""
    found = {}
    for text in texts:
        for prompt in signatures(text):
            if prompt.endswith(":\n") and parses(prompt + indentation(prompt.splitlines()[-1]) + "    pass\n"):
                found[prompt[:-1]] = None  # as the main job's prompts: the newline is the model's to write
    pool = sorted(found)
    if dev:
        evaluated = set(random.Random(seed).sample(pool, EVAL_SIGNATURES))
        pool, seed = [prompt for prompt in pool if prompt not in evaluated], seed + 1
    if count > len(pool):
        raise SystemExit(f"--signatures {count}: the held-out files have {len(pool)} distinct signatures"
                         + (" besides the evaluation's" if dev else ""))
    return random.Random(seed).sample(pool, count)


def signatures(text: str) -> list[str]:
    """A module's top-level functions as their def line(s), its classes' methods as the class's
    header line(s) then the method's; dedented, no decorators; none for a file that does not parse."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines(keepends=True)

    def header(node: ast.stmt) -> str:  # the node's line(s) up to its body
        return "".join(lines[node.lineno - 1 : first_line(node.body[0]) - 1])

    found = []
    for node in tree.body:
        if isinstance(node, FUNCTIONS):
            found.append(header(node))
        elif isinstance(node, ast.ClassDef):
            found += [header(node) + header(m) for m in node.body if isinstance(m, FUNCTIONS)]
    return [textwrap.dedent(prompt) for prompt in found]


def first_line(node: ast.stmt) -> int:
    """A statement's first line: its first decorator's, if it has any."""
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])


def indentation(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def parses(source: str) -> bool:
    try:
        ast.parse(source)
    except (SyntaxError, ValueError):
        return False
    return True


def cut_at_last_statement(signature: str, body: str, finished: bool) -> str:
    """signature + body up to the end of its last complete statement: where the function ends (a
    line back at the def's indentation or less); else, when the token limit stopped it, its complete
    lines, less a last statement that is unfinished (an open bracket or string) or a block header
    with no block, cut where a statement starts after a complete one. A body whose indentation is
    broken is kept whole, and fails to parse."""
    text = signature + (body if finished else body[: body.rfind("\n") + 1])  # less the unfinished line
    lines = text.splitlines(keepends=True)
    def_line, def_depth = len(signature.splitlines()), None
    depth, starts, header, previous = 0, [], False, None
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type in (tokenize.NL, tokenize.COMMENT):
                continue
            if token.type == tokenize.INDENT:
                depth += 1
            elif token.type == tokenize.DEDENT:
                depth -= 1
                if def_depth is not None and depth <= def_depth and token.start[0] <= len(lines):
                    return "".join(lines[: token.start[0] - 1])  # the function is over
            elif token.type == tokenize.NEWLINE:
                header = previous.string == ":"
                def_depth = depth if token.start[0] == def_line else def_depth
            elif previous is not None and previous.type in STATEMENT_END and not header \
                    and def_depth is not None and depth > def_depth:
                starts.append(token.start[0] - 1)  # a statement begins on this line, after a complete one
            previous = token
    except IndentationError:
        return text
    except tokenize.TokenError:  # the text ends inside an open bracket or string: an unfinished statement
        header = True
    if finished or not header:  # the text ends with a complete statement
        return text
    return "".join(lines[: starts[-1]]) if starts else signature


def repeats_a_line(body: str, times: int = 3) -> bool:
    """Whether some non-blank line of the body's complete lines comes `times` times in a row."""
    lines = [line.rstrip() for line in body.split("\n")[:-1]]
    return any(lines[i].strip() and len(set(lines[i : i + times])) == 1 for i in range(len(lines) - times + 1))


async def quality(model_dir: Path, signatures: list[str], generate_args: tuple[str, ...] = ()) -> dict:
    """generate_args: `shardspec generate` options the samples are drawn with (default: none, its defaults)."""
    defaults = build_parser().parse_args(["generate", "", *generate_args])
    penalties = sampling_penalties(defaults)
    samples = []
    async with shardspec.connect(model=str(model_dir), local=2, mtp=True) as engine:
        for seed, signature in enumerate(signatures):
            ids, final = [], None
            async for chunk in engine.generate(signature, max_tokens=defaults.max_tokens,
                                               temperature=defaults.temperature, top_k=defaults.top_k,
                                               top_p=defaults.top_p, seed=seed, **penalties):
                ids += chunk.token_ids
                final = chunk
            body = engine.tokenizer.decode(ids)
            cut = cut_at_last_statement(signature, body, final.finish_reason == "stop")
            samples.append({"signature": signature, "body": body, "cut": cut, "parses": parses(cut),
                            "repeats": repeats_a_line(body), "stats": final.stats})
    return {"signatures": len(samples), "max_tokens": defaults.max_tokens, "temperature": defaults.temperature,
            "top_k": defaults.top_k, "top_p": defaults.top_p, **penalties,
            "parse_rate": sum(s["parses"] for s in samples) / len(samples),
            "no_repeat_rate": sum(not s["repeats"] for s in samples) / len(samples),
            "mean_acceptance_length": statistics.mean(s["stats"]["mean_acceptance_length"] for s in samples),
            "tokens_per_s_median": statistics.median(s["stats"]["tokens_per_s"] for s in samples),
            "samples": samples}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=BUNDLED)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=65536, help="held-out tokens for the accuracy")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--signatures", type=int, default=EVAL_SIGNATURES,
                        help=f"held-out function signatures for the quality (default {EVAL_SIGNATURES})")
    parser.add_argument("--dev", action="store_true",
                        help="the quality on signatures other than the evaluation's (see held_out_signatures)")
    parser.add_argument("--generate", default="", metavar="ARGS",
                        help="the quality with these `shardspec generate` sampling options, e.g. "
                             "'--repetition-penalty 1.1' (default: none, generate's defaults)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["accuracy", "acceptance", "quality"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    texts = held_out_texts()
    result = {"python": sys.version.split()[0], "held_out_files": len(texts)}
    if "accuracy" not in args.skip:
        result |= next_token_accuracy(args.model, texts, args.tokens)
        print(json.dumps(result), flush=True)
    if "acceptance" not in args.skip:
        result["speculative"] = asyncio.run(
            acceptance(args.model, texts, args.k, args.prompts, args.prompt_len, args.new_tokens, args.tp)
        )
        print(json.dumps(result["speculative"]), flush=True)
    if "quality" not in args.skip:
        prompts = held_out_signatures(texts, args.signatures, seed=0, dev=args.dev)
        result["quality"] = asyncio.run(quality(args.model, prompts, tuple(shlex.split(args.generate))))
        print(json.dumps({k: v for k, v in result["quality"].items() if k != "samples"}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
