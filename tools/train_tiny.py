"""Train the bundled model: a byte-level BPE tokenizer and a tiny Qwen3.5 (Gated DeltaNet + gated
attention + one MTP layer) on the Python standard library's own source files.

    python tools/train_tiny.py prepare --out build/tiny        # CPU: split, tokenizer, token arrays
    python tools/train_tiny.py train --out build/tiny --device cuda --steps 6000
    python tools/train_tiny.py all --out build/tiny            # both

Deterministic given --seed: the file split is by a hash of each file's path, documents are shuffled
and batches drawn from seeded generators, and the weights are initialised from a seeded generator
(CUDA kernels may still differ in the last bits between GPUs). The model is trained with the next-
token loss plus the MTP loss (the MTP head predicts token t+2 from the embedding of token t+1 and
the final hidden state at t), and exported as a Hugging Face folder in bf16 that loads through the
same code path as any Qwen3.5 checkpoint.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from shardspec.layers.batch import Batch
from shardspec.layers.parallel import TPGroup
from shardspec.models.qwen3_5 import Qwen3_5Config, Qwen3_5Model

EOS = "<|endoftext|>"
HELD_OUT_PERCENT = 2
CONFIG = {
    "model_type": "qwen3_5_text",
    "architectures": ["Qwen3_5ForCausalLM"],
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 8,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
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


def encode(tokenizer, texts: list[str]) -> np.ndarray:
    """All documents as one stream, each followed by EOS."""
    eos = tokenizer.token_to_id(EOS)
    ids = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.uint16)


def prepare(out: Path, seed: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    train, held_out = read_split()
    order = np.random.default_rng(seed).permutation(len(train))
    train = [train[i] for i in order]
    tokenizer = train_tokenizer(train, CONFIG["vocab_size"])
    tokenizer.save(str(out / "tokenizer.json"))
    train_ids, held_out_ids = encode(tokenizer, train), encode(tokenizer, held_out)
    np.savez(out / "tokens.npz", train=train_ids, held_out=held_out_ids)
    info = {
        "python": sys.version.split()[0],
        "train_files": len(train),
        "held_out_files": len(held_out),
        "train_tokens": int(train_ids.size),
        "held_out_tokens": int(held_out_ids.size),
        "train_bytes": sum(len(t.encode()) for t in train),
    }
    (out / "data.json").write_text(json.dumps(info, indent=1))
    print(f"prepared {info}", file=sys.stderr)


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


def batches(tokens: np.ndarray, batch: int, length: int, generator: np.random.Generator, device: torch.device):
    stream = torch.from_numpy(tokens.astype(np.int64))
    while True:
        starts = generator.integers(0, len(stream) - length - 1, size=batch)
        yield torch.stack([stream[s : s + length] for s in starts]).to(device, non_blocking=True)


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


def train(out: Path, device: torch.device, steps: int, batch: int, length: int, lr: float, mtp_weight: float,
          seed: int) -> None:
    torch.manual_seed(seed)
    data = np.load(out / "tokens.npz")
    model = build_model(device, seed)
    params = sum(p.numel() for p in model.parameters())
    print(f"{params / 1e6:.2f}M parameters; {data['train'].size / 1e6:.1f}M train tokens", file=sys.stderr)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), fused=device.type == "cuda",
    )
    warmup = max(1, steps // 50)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))
    )
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    source = batches(data["train"], batch, length, np.random.default_rng(seed), device)
    started = time.perf_counter()
    log = []
    for step in range(1, steps + 1):
        ids = next(source)
        with autocast:
            main, mtp = losses(model, ids)
        loss = main + mtp_weight * mtp
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == steps:
            elapsed = time.perf_counter() - started
            tokens_per_s = step * batch * length / elapsed
            entry = {"step": step, "loss": main.item(), "mtp_loss": mtp.item(), "tokens_per_s": tokens_per_s}
            log.append(entry)
            print(f"step {step}/{steps} loss {main.item():.3f} mtp {mtp.item():.3f} "
                  f"{tokens_per_s / 1e3:.0f}k tok/s {elapsed:.0f}s", file=sys.stderr, flush=True)
    final = {"train": evaluate(model, data["train"][: data["held_out"].size], length, device, autocast),
             "held_out": evaluate(model, data["held_out"], length, device, autocast),
             "steps": steps, "batch": batch, "length": length, "lr": lr, "mtp_weight": mtp_weight,
             "seed": seed, "parameters": params, "train_seconds": time.perf_counter() - started,
             "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "log": log}
    (out / "train.json").write_text(json.dumps(final, indent=1))
    export(model, out)
    print(f"final {json.dumps({k: final[k] for k in ('train', 'held_out')})}", file=sys.stderr)


def export(model: Qwen3_5Model, out: Path) -> None:
    """The Hugging Face folder: config.json, model.safetensors (bf16), tokenizer files."""
    from safetensors.torch import save_file

    tensors = {}
    for name, param in model.named_parameters():
        tensors[model.checkpoint_key(name)] = param.detach().to("cpu", torch.bfloat16).contiguous()
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
    parser.add_argument("stage", choices=["prepare", "train", "all"])
    parser.add_argument("--out", type=Path, default=Path("build/tiny"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--mtp-weight", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.stage in ("prepare", "all"):
        prepare(args.out, args.seed)
    if args.stage in ("train", "all"):
        train(args.out, torch.device(args.device), args.steps, args.batch, args.length, args.lr, args.mtp_weight,
              args.seed)


if __name__ == "__main__":
    main()
