"""Resident memory of each worker after `load`, at several TP degrees: a worker holds only its shard.

    python bench/memory.py [--tp 1 2] [--out DIR] [--device cpu]

Writes a random fp32 checkpoint of about 300 MB (once), then for each TP degree spawns that many
local workers (CPU ones unless --device says otherwise), loads it, and reads each worker's `stats`:
weight bytes held, RSS and anonymous RSS (the part that is the process's own memory, not page cache
mapped from the file).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

import shardspec
from shardspec.testing.random_checkpoint import tiny_config, write_random_checkpoint

CONFIG = tiny_config(
    vocab_size=32768, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=4, head_dim=128, linear_num_key_heads=8,
    linear_num_value_heads=16, linear_key_head_dim=64, linear_value_head_dim=64,
)


async def measure(model: Path, tp: int, device: str) -> list:
    async with shardspec.connect(model=str(model), local=tp, device=device, max_seqs=1, max_seq_len=64) as engine:
        return await engine.stats()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", type=Path, default=None, help="where to write the checkpoint (default: temp)")
    parser.add_argument("--device", default="cpu",
                        help="the workers' device, cpu, cuda or cuda:N (default cpu: resident memory of CPU workers)")
    args = parser.parse_args()
    folder = args.out or Path(tempfile.mkdtemp(prefix="shardspec-mem-"))
    if not (folder / "config.json").exists():
        write_random_checkpoint(folder, CONFIG, seed=0)
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    print(f"checkpoint: {size / 1e6:.0f} MB fp32 at {folder}")
    print("| TP | rank | weights held (MB) | RSS (MB) | anonymous RSS (MB) |")
    print("|---|---|---|---|---|")
    for tp in args.tp:
        for s in asyncio.run(measure(folder, tp, args.device)):
            print(f"| {tp} | {s.rank} | {s.weight_bytes / 1e6:.0f} | {s.rss_bytes / 1e6:.0f} "
                  f"| {s.rss_anon_bytes / 1e6:.0f} |")


if __name__ == "__main__":
    main()
