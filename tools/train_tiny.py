"""Train the bundled model: a tiny Qwen3.5 (Gated DeltaNet + gated attention + one MTP layer) on
the Python standard library's own source files and the .py files of the sdists pinned in
tools/tiny_corpus.json, with the bundled model's byte-level BPE tokenizer.

    python tools/train_tiny.py pin NAME==VERSION ...           # add sdists to the manifest
    python tools/train_tiny.py prepare --out build/tiny        # CPU: download, check, split, tokens
    python tools/train_tiny.py train --out build/tiny --minutes 7 --max-epochs 6   # on a GPU
    python tools/train_tiny.py all --out build/tiny            # both

A run longer than one sitting: `train --steps N --pause-after MINUTES` stops after about that long
and saves the run to OUT/train-state.pt; the same command with `--resume` goes on from there and
ends with the weights an uninterrupted run would have.

The held-out files are the stdlib's whose path hashes below HELD_OUT_PERCENT (the same files on
every machine with the same Python); training drops exact copies of them, and package files that
share LEAK_FRACTION of their line windows with them. `prepare` downloads each sdist once into
--cache and refuses one whose sha256 is not the manifest's. Deterministic given --seed (and
--steps; train.json records the steps --minutes chose): documents are shuffled and batches drawn
from seeded generators, and the weights are initialised from a seeded generator (CUDA kernels may
still differ in the last bits between GPUs). The model is trained with the next-token loss plus the
MTP loss (the MTP head predicts token t+2 from the embedding of token t+1 and the final hidden
state at t), and exported as a Hugging Face folder in bf16 that loads through the same code path as
any Qwen3.5 checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import lzma
import math
import re
import sys
import sysconfig
import tarfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from shardspec import kernels
from shardspec.layers import gdn as gdn_layer
from shardspec.layers.batch import Batch
from shardspec.layers.parallel import TPGroup, slice_specs
from shardspec.models.loader import sources
from shardspec.models.qwen3_5 import Qwen3_5Config, Qwen3_5Model

EOS = "<|endoftext|>"
HELD_OUT_PERCENT = 2
CORPUS = Path(__file__).with_name("tiny_corpus.json")  # the pinned packages trained on besides the stdlib
INDEX = "https://pypi.org/simple"
BUNDLED = Path(__file__).resolve().parents[1] / "src" / "shardspec" / "bundled"
MAX_FILE_BYTES = 1 << 20
MAX_DIGIT_FRACTION = 0.3
SHINGLE_LINES = 4
WARMUP_STEPS = 8  # rate: steps before the timing (kernels compiled and tuned)
RATE_CHUNKS = (64, 32, 16)  # rate: the PyTorch delta rule's chunk sizes timed (the first is gdn.CHUNK's default)
TIMED_STEPS = (10, 30)  # --minutes: the rate is timed between these steps (kernels compiled and tuned)
FINAL_RESERVE_S = 30.0  # --minutes: left for the final losses and the export
EVAL_SHARE = 0.03  # --minutes: the share of the time the held-out losses take on the way
STATE = "train-state.pt"  # --pause-after: a paused run's state, in --out
LEAK_FRACTION = 0.2  # a training file sharing this much of its line windows with held-out files is dropped
CONFIG = {
    "model_type": "qwen3_5_text",
    "architectures": ["Qwen3_5ForCausalLM"],
    "vocab_size": 4096,
    "hidden_size": 384,
    "intermediate_size": 1152,
    "num_hidden_layers": 8,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 6,
    "linear_num_value_heads": 12,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "hidden_act": "silu",
    "attention_bias": False,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "mtp_num_hidden_layers": 1,
    "bos_token_id": None,
    "pad_token_id": None,
    "dtype": "bfloat16",
}
CHAT_TEMPLATE = (
    "{% for message in messages %}# {{ message['role'] }}:\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}# assistant:\n{% endif %}"
)


# --- data -------------------------------------------------------------------------------------


def stdlib_files() -> list[tuple[str, Path]]:
    """(path relative to the stdlib, path) of every .py file of this Python's standard library."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts]
    return sorted((str(p.relative_to(root)), p) for p in files)


def is_held_out(relative: str) -> bool:
    """About HELD_OUT_PERCENT % of files, chosen by a hash of the path: the same on every machine."""
    return int(hashlib.sha256(relative.encode()).hexdigest(), 16) % 100 < HELD_OUT_PERCENT


def read_split() -> tuple[list[str], list[str]]:
    train, held_out = [], []
    for relative, path in stdlib_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        (held_out if is_held_out(relative) else train).append(text)
    return train, held_out


def fetch(entry: dict, cache: Path) -> Path:
    """The manifest's file of one package, downloaded from the index once and checked against its sha256."""
    path = cache / entry["file"]
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with urllib.request.urlopen(entry["url"], timeout=300) as response:
            path.with_suffix(".part").write_bytes(response.read())
        path.with_suffix(".part").rename(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != entry["sha256"]:
        raise SystemExit(f"{path}: sha256 {digest}, the manifest {CORPUS.name} says {entry['sha256']}; "
                         f"delete the file to download it again")
    return path


def package_sources(archive: Path) -> list[str]:
    """The .py files of an sdist (a .tar.gz) in member order, less numeric tables (files over
    MAX_FILE_BYTES or with more than MAX_DIGIT_FRACTION of digits: test results, generated data)."""
    texts = []
    with tarfile.open(archive) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            if member.isfile() and member.name.endswith(".py") and member.size <= MAX_FILE_BYTES:
                text = tar.extractfile(member).read().decode("utf-8", errors="replace")
                if sum(c.isdigit() for c in text) <= MAX_DIGIT_FRACTION * len(text):
                    texts.append(text)
    return texts


def shingles(text: str) -> set[int]:
    """Hashes of every SHINGLE_LINES consecutive non-blank lines (stripped): a file's fingerprint."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    windows = ("\n".join(lines[i : i + SHINGLE_LINES]) for i in range(max(1, len(lines) - SHINGLE_LINES + 1)))
    return {hash(window) for window in windows}


def training_documents(train: list[str], held_out: list[str], cache: Path) -> tuple[list[str], list[dict]]:
    """The stdlib training files and the manifest's packages' .py files, less exact duplicates (of a
    held-out file or of one kept before) and any package file that shares LEAK_FRACTION of its line
    windows with the held-out files (vendored copies of the stdlib; the stdlib's own training files
    stay as the split makes them)."""
    held_out_shingles = set().union(*(shingles(t) for t in held_out))
    seen = {hashlib.sha256(t.encode()).digest() for t in held_out}
    documents, sources = [], []
    packages = json.loads(CORPUS.read_text())["packages"]
    for name, version, texts in [("stdlib", sys.version.split()[0], train)] + [
            (p["name"], p["version"], package_sources(fetch(p, cache))) for p in packages]:
        kept = duplicates = leaks = 0
        for text in texts:
            digest = hashlib.sha256(text.encode()).digest()
            if digest in seen:
                duplicates += 1
            elif name != "stdlib" and len((own := shingles(text)) & held_out_shingles) >= LEAK_FRACTION * len(own):
                leaks += 1
            else:
                documents.append(text)
                kept += 1
            seen.add(digest)
        sources.append({"name": name, "version": version, "files": kept, "duplicates_dropped": duplicates,
                        "held_out_overlaps_dropped": leaks, "documents": range(len(documents) - kept, len(documents))})
    return documents, sources


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def encode(tokenizer, texts: list[str], batch: int = 512) -> list[np.ndarray]:
    """Each document's tokens followed by EOS (a batch of documents at a time: an Encoding holds
    far more than its ids)."""
    eos = tokenizer.token_to_id(EOS)
    return [np.asarray([*e.ids, eos], dtype=np.uint16) for start in range(0, len(texts), batch)
            for e in tokenizer.encode_batch(texts[start : start + batch], add_special_tokens=False)]


def save_tokens(path: Path, ids: np.ndarray) -> None:
    """A token stream as xz-compressed little-endian uint16 (small enough to carry to a GPU machine)."""
    path.write_bytes(lzma.compress(ids.astype("<u2").tobytes(), preset=9 | lzma.PRESET_EXTREME))


def load_tokens(path: Path) -> np.ndarray:
    return np.frombuffer(lzma.decompress(path.read_bytes()), dtype="<u2")


def prepare(out: Path, seed: int, cache: Path, new_tokenizer: bool) -> None:
    from tokenizers import Tokenizer

    out.mkdir(parents=True, exist_ok=True)
    train, held_out = read_split()
    documents, sources = training_documents(train, held_out, cache)
    if new_tokenizer:
        tokenizer = train_tokenizer(train, CONFIG["vocab_size"])
    else:  # the bundled model's tokenizer, trained on the stdlib: losses stay comparable per token
        tokenizer = Tokenizer.from_file(str(BUNDLED / "tokenizer.json"))
    tokenizer.save(str(out / "tokenizer.json"))
    encoded = encode(tokenizer, documents)
    order = np.random.default_rng(seed).permutation(len(documents))
    train_ids = np.concatenate([encoded[i] for i in order])
    held_out_ids = np.concatenate(encode(tokenizer, held_out))
    save_tokens(out / "train.tokens.xz", train_ids)
    save_tokens(out / "held_out.tokens.xz", held_out_ids)
    for source in sources:
        docs = source.pop("documents")
        source["tokens"] = int(sum(encoded[i].size for i in docs))
        source["bytes"] = sum(len(documents[i].encode()) for i in docs)
    info = {
        "python": sys.version.split()[0],
        "held_out_files": len(held_out),
        "held_out_tokens": int(held_out_ids.size),
        "held_out_bytes": sum(len(t.encode()) for t in held_out),
        "train_files": len(documents),
        "train_tokens": int(train_ids.size),
        "train_bytes": sum(s["bytes"] for s in sources),
        "sources": sources,
    }
    (out / "data.json").write_text(json.dumps(info, indent=1))
    print(f"prepared {json.dumps({k: v for k, v in info.items() if k != 'sources'})}", file=sys.stderr)


def pin(specs: list[str]) -> None:
    """Add NAME==VERSION sdists to the manifest: file, URL and sha256 as PyPI's simple index lists them."""
    manifest = json.loads(CORPUS.read_text()) if CORPUS.exists() else {"packages": []}
    for spec in specs:
        name, _, version = spec.partition("==")
        request = urllib.request.Request(f"{INDEX}/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            files = json.load(response)["files"]
        wanted = f"{name}-{version}.tar.gz"
        match = [f for f in files if normalise(f["filename"]) == normalise(wanted)]
        if not match:
            raise SystemExit(f"{spec}: no sdist {wanted} on {INDEX}")
        entry = {"name": name, "version": version, "file": match[0]["filename"], "url": match[0]["url"],
                 "sha256": match[0]["hashes"]["sha256"], "bytes": match[0]["size"]}
        manifest["packages"] = [p for p in manifest["packages"] if p["name"] != name] + [entry]
    CORPUS.write_text(json.dumps(manifest, indent=1) + "\n")


def normalise(name: str) -> str:
    """A distribution's file name compared as PEP 503 compares names (case and runs of -_. folded)."""
    return re.sub(r"[-_.]+", "-", name).lower()


# --- model ------------------------------------------------------------------------------------


def build_model(device: torch.device, seed: int) -> Qwen3_5Model:
    config = Qwen3_5Config.from_dict(CONFIG)
    with torch.device(device):
        model = Qwen3_5Model(config, TPGroup(), with_mtp=True)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in model.named_parameters():
        param.requires_grad_(True)
        with torch.no_grad():
            param.copy_(initial_value(name, tuple(param.shape), generator))
    return model


def initial_value(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Standard small-model initialisation; zero-centred norms start at 0 (a gain of 1)."""
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(1.0, 16.0, generator=generator).log()
    if name.endswith("dt_bias"):
        return torch.ones(shape)
    if name.endswith("linear_attn.norm.weight"):
        return torch.ones(shape)
    if "norm" in name:
        return torch.zeros(shape)
    if name.endswith("conv1d_weight"):
        return torch.randn(shape, generator=generator) / math.sqrt(shape[-1])
    std = 0.02
    if name.endswith(("o_proj.weight", "down_proj.weight", "out_proj.weight")):
        std /= math.sqrt(2 * CONFIG["num_hidden_layers"])  # residual branches: keep the sum's scale
    return torch.randn(shape, generator=generator) * std


def losses(model: Qwen3_5Model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token loss of the target, and the MTP loss (token t+2 from token t+1 and hidden t)."""
    B, T = ids.shape
    hidden = model(ids, Batch.uncached(B, T, ids.device))
    logits = model.lm_head.local_logits(hidden[:, :-1])
    main = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    mtp_hidden = model.draft(ids[:, 1:-1], hidden[:, :-2], Batch.uncached(B, T - 2, ids.device))
    mtp_logits = model.lm_head.local_logits(mtp_hidden)
    mtp = F.cross_entropy(mtp_logits.flatten(0, 1), ids[:, 2:].flatten())
    return main, mtp


def batches(stream: torch.Tensor, batch: int, length: int, generator: np.random.Generator):
    """Random windows of `length` tokens from the token stream (already on the training device)."""
    offsets = torch.arange(length, device=stream.device)
    while True:
        starts = torch.from_numpy(generator.integers(0, len(stream) - length - 1, size=batch)).to(stream.device)
        yield stream[starts[:, None] + offsets]


@torch.no_grad()
def evaluate(model: Qwen3_5Model, tokens: np.ndarray, length: int, device: torch.device,
             autocast: torch.autocast) -> dict[str, float]:
    """Held-out losses over consecutive windows covering the whole held-out stream."""
    model.eval()
    stream = torch.from_numpy(tokens.astype(np.int64))
    windows = stream[: len(stream) // length * length].view(-1, length)
    totals = {"loss": 0.0, "mtp_loss": 0.0}
    for chunk in windows.split(32):
        with autocast:
            main, mtp = losses(model, chunk.to(device))
        totals["loss"] += main.item() * len(chunk)
        totals["mtp_loss"] += mtp.item() * len(chunk)
    model.train()
    return {k: v / len(windows) for k, v in totals.items()}


def fla_delta_rule(qkv, a, b, A_log, dt_bias, state, slots, k_heads, dk, **_):
    """The gated delta rule through fla-core's chunked kernel, which has a backward pass (the
    PyTorch reference's is several times slower); training has no per-slot state, so it starts
    from zeros."""
    B, HV = qkv.shape[0], A_log.shape[0]
    zeros = torch.zeros(B, HV, dk, (qkv.shape[-1] - 2 * k_heads * dk) // HV, device=qkv.device)
    return kernels.gdn.delta_rule(qkv, a, b, A_log, dt_bias, zeros, torch.arange(B, device=qkv.device), k_heads, dk)


def gradients(model: Qwen3_5Model, ids: torch.Tensor, autocast: torch.autocast) -> tuple[float, list[torch.Tensor]]:
    """The loss on one batch and the gradient of every weight matrix; fails naming any parameter
    that gets none (a layer that ran an inference kernel, which has no backward pass)."""
    model.zero_grad(set_to_none=True)
    with autocast:
        main, mtp = losses(model, ids)
    (main + mtp).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum().item()]
    if missing:
        raise RuntimeError(f"no gradient reaches {', '.join(missing)}")
    grads = [p.grad.float().flatten() for p in model.parameters() if p.dim() >= 2]
    model.zero_grad(set_to_none=True)
    return (main + mtp).item(), grads


def lift_fla_hopper_guard(key_head_dim: int) -> bool:
    """fla-core refuses its gated backward on Hopper under Triton 3.4.0–3.7.0 (fla issue #640). The
    miscompile bisected there is of the 64-wide key block alone (32 and 128 come out right), and a
    key head of dk takes a block of next_power_of_2(dk) clamped to [16, 128]: lift the guard for the
    other widths. The gradient check against the reference decides all the same. -> lifted?"""
    try:
        from fla.ops.common import chunk_o
    except ImportError:
        return False
    block = min(max(1 << (key_head_dim - 1).bit_length(), 16), 128)
    if block == 64 or chunk_o.TRITON_ABOVE_3_7_1:
        return False
    chunk_o.TRITON_ABOVE_3_7_1 = True
    return True


def choose_gdn(model: Qwen3_5Model, ids: torch.Tensor, autocast: torch.autocast, wanted: str) -> dict:
    """Train through fla when it is installed and its loss and gradients match the reference's on
    the first batch; else through the reference."""
    reference = gdn_layer.delta_rule
    torch_loss, torch_grads = gradients(model, ids, autocast)
    fla = getattr(getattr(kernels, "gdn", None), "chunk_gated_delta_rule", None)  # kernels.gdn needs Triton
    if wanted == "torch" or ids.device.type != "cuda" or fla is None:
        return {"gdn": "torch"}
    gdn_layer.delta_rule = fla_delta_rule
    lifted = lift_fla_hopper_guard(CONFIG["linear_key_head_dim"])
    try:
        fla_loss, fla_grads = gradients(model, ids, autocast)
    except Exception as exc:  # any failure of the optional kernel: train on the reference
        gdn_layer.delta_rule = reference
        return {"gdn": "torch", "fla_check": {"error": repr(exc), "hopper_guard_lifted": lifted}}
    cosines = [F.cosine_similarity(r, f, dim=0).item() for r, f in zip(torch_grads, fla_grads, strict=True)]
    check = {"reference_loss": torch_loss, "fla_loss": fla_loss, "min_weight_grad_cosine": min(cosines),
             "hopper_guard_lifted": lifted}
    if abs(fla_loss - torch_loss) > 0.01 * torch_loss or min(cosines) < 0.99:
        gdn_layer.delta_rule = reference
        return {"gdn": "torch", "fla_check": check}
    return {"gdn": "fla", "fla_check": check}


def learning_rate_factor(step: int, warmup: int, plan: dict) -> float:
    """Linear warm-up over `warmup` steps, then a cosine to 0 at plan["steps"] (set once the
    warm-up's first steps have been timed, when training to a time budget)."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, plan["steps"] - warmup))))


def train_step(model: Qwen3_5Model, optimizer: torch.optim.Optimizer, ids: torch.Tensor, autocast: torch.autocast,
               mtp_weight: float, loss_fn=losses) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on a batch; returns its next-token and MTP losses."""
    with autocast:
        main, mtp = loss_fn(model, ids)
    optimizer.zero_grad(set_to_none=True)
    (main + mtp_weight * mtp).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return main, mtp


def steps_that_fit(timed: dict[int, float], deadline: float, most: float) -> int:
    """The steps done by the deadline at the rate of the steps timed (warmed up: kernels compiled
    and tuned), less the time the final losses and the export take; at most `most`."""
    (first, start), (last, end) = sorted(timed.items())
    left = (deadline - end - FINAL_RESERVE_S) * (1 - EVAL_SHARE)
    return max(last, min(int(most), last + int(left / ((end - start) / (last - first)))))


def make_optimizer(model: Qwen3_5Model, lr: float, device: torch.device) -> torch.optim.Optimizer:
    """AdamW, weight decay 0.1 on the matrices only."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), fused=device.type == "cuda",
    )


def training_losses(compile_: bool):
    """The loss function a training step calls: `losses`, or the same compiled by torch.compile (one
    graph per batch shape; the held-out losses stay eager, their batches differ)."""
    return torch.compile(losses) if compile_ else losses


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the GPU's time, not the time to queue the work


def rate(out: Path, device: torch.device, batch: int, length: int, steps: int, seed: int) -> None:
    """Tokens/s of a training step on each path (gated delta rule: the PyTorch reference at chunks of
    RATE_CHUNKS tokens and fla-core's kernel where it passes the gradient check, eager; the fastest of
    them through torch.compile), timed over `steps` steps after warm-up, and the heaviest kernels of
    the fastest path's step. Writes OUT/rate.json."""
    kernels.use(dataclasses.replace(kernels.settings, kernels=False))
    reference = gdn_layer.delta_rule
    train_tokens = load_tokens(out / "train.tokens.xz")
    source = batches(torch.from_numpy(train_tokens.astype(np.int64)).to(device), batch, length,
                     np.random.default_rng(seed))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    results, fastest = [], None
    eager = [("torch", chunk, False) for chunk in RATE_CHUNKS] + [("fla", None, False)]
    for path, chunk, compile_ in [*eager, (None, None, True)]:  # compiled: the fastest eager path
        if compile_:
            path, chunk = fastest[0]["gdn"], fastest[0]["gdn_chunk"]
        gdn_layer.delta_rule, gdn_layer.CHUNK = reference, chunk or RATE_CHUNKS[0]
        model = build_model(device, seed)
        info = choose_gdn(model, next(source), autocast, path)
        entry = {"path": path, "gdn_chunk": chunk, "compile": compile_, **info}
        if info["gdn"] != path:
            why = "fla-core failed the gradient check" if "fla_check" in info else "no fla-core on CUDA here"
            results.append({**entry, "skipped": why})
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
            continue
        optimizer, loss_fn = make_optimizer(model, 1e-4, device), training_losses(compile_)
        started = time.perf_counter()
        for _ in range(WARMUP_STEPS):
            train_step(model, optimizer, next(source), autocast, 0.5, loss_fn)
        synchronize(device)
        warm = time.perf_counter()
        for _ in range(steps):
            train_step(model, optimizer, next(source), autocast, 0.5, loss_fn)
        synchronize(device)
        elapsed = time.perf_counter() - warm
        entry.update(warmup_s=warm - started, step_ms=1e3 * elapsed / steps,
                     tokens_per_s=steps * batch * length / elapsed)
        results.append(entry)
        print(json.dumps(entry), file=sys.stderr, flush=True)
        if fastest is None or entry["tokens_per_s"] > fastest[0]["tokens_per_s"]:
            fastest = (entry, model, optimizer, loss_fn)
    entry, model, optimizer, loss_fn = fastest
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(3):
            train_step(model, optimizer, next(source), autocast, 0.5, loss_fn)
        synchronize(device)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=25)
    print(f"fastest: {entry['gdn']}, compile={entry['compile']} (3 steps profiled)\n{table}", file=sys.stderr)
    summary = {"batch": batch, "length": length, "steps": steps, "paths": results,
               "profile_fastest": table}
    (out / "rate.json").write_text(json.dumps(summary, indent=1))


def train(out: Path, device: torch.device, steps: int, minutes: float | None, max_epochs: float | None, batch: int,
          length: int, lr: float, warmup: int, mtp_weight: float, eval_every: int, gdn: str, seed: int,
          compile_: bool = False, pause_after: float | None = None, resume: bool = False) -> bool:
    """Train (or go on with a paused run when `resume`); with `pause_after` minutes, stop once they
    have passed and save everything the run needs to go on to OUT/train-state.pt. Returns whether
    the run finished (and exported the model)."""
    begun = time.perf_counter()
    deadline = begun + (minutes or 0) * 60
    # the inference kernels (norms, SiLU·mul) have no backward pass
    kernels.use(dataclasses.replace(kernels.settings, kernels=False))
    torch.manual_seed(seed)
    train_tokens, held_out = load_tokens(out / "train.tokens.xz"), load_tokens(out / "held_out.tokens.xz")
    model = build_model(device, seed)
    params = sum(p.numel() for p in model.parameters())
    print(f"{params / 1e6:.2f}M parameters; {train_tokens.size / 1e6:.1f}M train tokens", file=sys.stderr)
    optimizer = make_optimizer(model, lr, device)
    plan = {"steps": steps}
    epoch_steps = train_tokens.size / (batch * length)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: learning_rate_factor(s, warmup, plan))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    stream = torch.from_numpy(train_tokens.astype(np.int64)).to(device)
    rng = np.random.default_rng(seed)
    settings = {"batch": batch, "length": length, "lr": lr, "warmup": warmup, "mtp_weight": mtp_weight,
                "seed": seed, "gdn_chunk": gdn_layer.CHUNK, "train_tokens": int(train_tokens.size)}
    log, timed, step, before = [], {}, 0, 0.0  # before: the seconds trained before a pause
    if resume:
        step, plan["steps"], log, before, info = resume_state(out, settings, model, optimizer, schedule, rng)
        minutes = None  # the plan was made when the run began
        print(f"resumed at step {step}/{plan['steps']}", file=sys.stderr, flush=True)
    source = batches(stream, batch, length, rng)
    if not resume:
        info = choose_gdn(model, next(source), autocast, gdn)
    elif info["gdn"] == "fla":
        lift_fla_hopper_guard(CONFIG["linear_key_head_dim"])
        gdn_layer.delta_rule = fla_delta_rule
    print(f"gated delta rule: {json.dumps(info)}", file=sys.stderr, flush=True)
    loss_fn = training_losses(compile_)
    started = time.perf_counter() - before
    while step < plan["steps"]:
        if pause_after is not None and step > 0 and time.perf_counter() - begun >= pause_after * 60:
            save_state(out, settings, step, plan["steps"], log, time.perf_counter() - started, info,
                       model, optimizer, schedule, rng)
            print(f"paused at step {step}/{plan['steps']}: go on with the same command and --resume",
                  file=sys.stderr, flush=True)
            return False
        step += 1
        main, mtp = train_step(model, optimizer, next(source), autocast, mtp_weight, loss_fn)
        schedule.step()
        if minutes and step in TIMED_STEPS:
            synchronize(device)
            timed[step] = time.perf_counter()
            if len(timed) == len(TIMED_STEPS):
                fit = steps_that_fit(timed, deadline, max_epochs * epoch_steps if max_epochs else math.inf)
                plan["steps"] = max(warmup + 1, fit)
        if step % 100 == 0 or step == plan["steps"]:
            elapsed = time.perf_counter() - started
            entry = {"step": step, "loss": main.item(), "mtp_loss": mtp.item(),
                     "tokens_per_s": step * batch * length / elapsed, "seconds": elapsed}
            if step % eval_every == 0 or step == plan["steps"]:
                entry["held_out"] = evaluate(model, held_out, length, device, autocast)
            log.append(entry)
            print(f"step {step}/{plan['steps']} {json.dumps(entry)}", file=sys.stderr, flush=True)
    final = {"train": evaluate(model, train_tokens[: held_out.size], length, device, autocast),
             "held_out": evaluate(model, held_out, length, device, autocast),
             "steps": plan["steps"], "batch": batch, "length": length, "gdn_chunk": gdn_layer.CHUNK, "lr": lr,
             "warmup": warmup,
             "mtp_weight": mtp_weight, "seed": seed, "parameters": params,
             "train_tokens": int(train_tokens.size), "tokens_seen": plan["steps"] * batch * length,
             "epochs": plan["steps"] / epoch_steps, "compile": compile_, **info,
             "train_seconds": time.perf_counter() - started,
             "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "log": log}
    (out / "train.json").write_text(json.dumps(final, indent=1))
    export(model, out)
    (out / STATE).unlink(missing_ok=True)
    print(f"final {json.dumps({k: final[k] for k in ('train', 'held_out', 'steps', 'epochs')})}", file=sys.stderr)
    return True


def save_state(out: Path, settings: dict, step: int, steps: int, log: list, seconds: float, info: dict,
               model: Qwen3_5Model, optimizer: torch.optim.Optimizer, schedule, rng: np.random.Generator) -> None:
    """What a paused run needs to go on as if it had not stopped: the weights, the optimizer's
    moments, the schedule, the batch generator's state, the plan and the log so far."""
    state = {"settings": settings, "step": step, "steps": steps, "log_json": json.dumps(log), "seconds": seconds,
             "info_json": json.dumps(info), "rng_json": json.dumps(rng.bit_generator.state),
             "model": model.state_dict(), "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict()}
    partial = out / (STATE + ".partial")
    torch.save(state, partial)
    partial.replace(out / STATE)  # never a half-written state in place of a good one


def resume_state(out: Path, settings: dict, model: Qwen3_5Model, optimizer: torch.optim.Optimizer, schedule,
                 rng: np.random.Generator) -> tuple[int, int, list, float, dict]:
    """Load OUT/train-state.pt into the run's objects; refuse one saved with other settings."""
    path = out / STATE
    if not path.is_file():
        raise SystemExit(f"error: --resume: no paused run at {path}")
    state = torch.load(path, map_location="cpu", weights_only=True)  # our own file: tensors and plain values
    if state["settings"] != settings:
        differ = sorted(k for k in settings if state["settings"].get(k) != settings[k])
        raise SystemExit(f"error: --resume: {path} was saved with other settings ({', '.join(differ)}): "
                         f"{ {k: state['settings'].get(k) for k in differ} }")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["schedule"])
    rng.bit_generator.state = json.loads(state["rng_json"])
    return (state["step"], state["steps"], json.loads(state["log_json"]), state["seconds"],
            json.loads(state["info_json"]))


def export(model: Qwen3_5Model, out: Path) -> None:
    """The Hugging Face folder: config.json, model.safetensors (bf16), tokenizer files."""
    from safetensors.torch import save_file

    tensors = {}
    specs = slice_specs(model)
    for name, param in model.named_parameters():
        stacked = specs[name].parts is not None  # a stacked weight: one checkpoint tensor per part
        sizes = model.get_submodule(name.rsplit(".", 1)[0]).sizes if stacked else [param.shape[0]]
        for key, rows in zip(sources(model, name, specs[name]), param.detach().split(sizes), strict=True):
            tensors[key] = rows.to("cpu", torch.bfloat16).contiguous()
    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    eos = json.loads((out / "tokenizer.json").read_text())["added_tokens"][0]["id"]
    (model_dir / "config.json").write_text(json.dumps({**CONFIG, "eos_token_id": eos}, indent=1))
    (model_dir / "tokenizer.json").write_text((out / "tokenizer.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "model_max_length": CONFIG[
            "max_position_embeddings"], "chat_template": CHAT_TEMPLATE}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=["pin", "prepare", "train", "all", "rate"],
                        help="rate: time a training step on each path (see --rate-steps) instead of training")
    parser.add_argument("packages", nargs="*", metavar="NAME==VERSION", help="pin: the sdists to add to the manifest")
    parser.add_argument("--out", type=Path, default=Path("build/tiny"))
    parser.add_argument("--cache", type=Path, default=Path("build/tiny-sources"), help="downloaded sdists")
    parser.add_argument("--new-tokenizer", action="store_true",
                        help="train a new tokenizer on the stdlib (default: the bundled model's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--minutes", type=float, help="instead of --steps: the steps that fit in about this long, "
                        "all included, at the rate of the first steps (train.json records them for --steps)")
    parser.add_argument("--max-epochs", type=float, help="with --minutes: at most this many passes over the data")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=100, help="warm-up steps")
    parser.add_argument("--mtp-weight", type=float, default=0.5)
    parser.add_argument("--eval-every", type=int, default=500, help="held-out loss every N steps")
    parser.add_argument("--gdn", choices=["auto", "torch"], default="auto",
                        help="auto: fla-core's kernel where installed and checked against the reference on CUDA")
    parser.add_argument("--compile", action="store_true",
                        help="train through torch.compile (the first steps then take a minute or two longer)")
    parser.add_argument("--rate-steps", type=int, default=20, help="rate: timed steps per path")
    parser.add_argument("--gdn-chunk", type=int, default=None, metavar="T",
                        help="tokens per chunk of the PyTorch gated delta rule (default: shardspec.layers.gdn.CHUNK, "
                             "64); its triangular solves cost less with fewer")
    parser.add_argument("--pause-after", type=float, metavar="MINUTES",
                        help="train: stop after about this long and save the run to OUT/" + STATE +
                        " (default: run to the end)")
    parser.add_argument("--resume", action="store_true",
                        help="train: go on with the run paused in --out (same settings; its plan of steps is kept)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.gdn_chunk:
        gdn_layer.CHUNK = args.gdn_chunk
    if args.stage == "pin":
        pin(args.packages)
    if args.stage in ("prepare", "all"):
        prepare(args.out, args.seed, args.cache, args.new_tokenizer)
    if args.stage in ("train", "all"):
        train(args.out, torch.device(args.device), args.steps, args.minutes, args.max_epochs, args.batch, args.length,
              args.lr, args.warmup, args.mtp_weight, args.eval_every, args.gdn, args.seed, args.compile,
              args.pause_after, args.resume)
    if args.stage == "rate":
        rate(args.out, torch.device(args.device), args.batch, args.length, args.rate_steps, args.seed)


if __name__ == "__main__":
    main()
