"""What a tree of guesses can reach at PP = 2, batch 1: a step's time from the loop's parts.

    python bench/tree_bound.py [--link-ms 12] [--stage0-ms 9.2] [--stage1-ms 17.8] [--chain-ms 13.5]
                               [--tree-pass-ms 19.5] [--far-step-ms 24.4] [--held 0 0.5 0.62 0.73 1]

The parts, as a step's timeline shows them (docs/benchmarks.md, "What bounds the tree"): L, one way
over the link with what sending and receiving cost; T0, stage 0's pass of one row after the record;
S1, the last stage's verify, acceptance and drafts; B, the last stage's chain of the next tree's
branches after each record; T0w, stage 0's fork, commit and pass over the tree's rows (the defaults:
the medians of a 2-core run's timelines, docs/data/tree-10ms-b1-parts.log). Steps follow
the protocol of shard_worker/stage.py and guessing.py, event by event, with the trees holding at
random at the given share:

- stage 0 runs the tree of step k + 2 once the branches the last stage sent after record k are in
  (record k's time + B + L) and it is free; the tree leaves T0w later;
- step k + 1's pass is the tree's row where its branch held, else a redo that stage 0 starts when
  record k is in (+ L) and it is free, T0 long;
- the last stage verifies step k + 1 once that pass is in and its chain after record k is done:
  record k + 1 = max(pass in, record k + B) + S1.

No tree (B = 0, nothing held) gives 2L + T0 + S1 a step. Two steps are in flight at most: a tree
holds the step after the one in flight, never the one after that. Ms a step, not tokens: a held
branch's drafts are the MTP head's own chain, so its steps keep fewer tokens (the MAL column of the
benchmark rows).
"""

from __future__ import annotations

import argparse
import random


def step_ms(held: float, link: float, stage0: float, stage1: float, chain: float, tree_pass: float,
            steps: int = 20000, seed: int = 0) -> float:
    """Mean ms a step over `steps` steps whose trees hold with probability `held`."""
    rng = random.Random(seed)
    record = 0.0  # the time the last stage sent record k
    stage0_free = tree_sent = tree_pass  # the first tree's (of step 1) send time
    for _ in range(steps):
        if rng.random() < held:
            arrives = tree_sent + link
        else:  # the redo, on record k's tokens
            stage0_free = max(record + link, stage0_free) + stage0
            arrives = stage0_free + link
        stage0_free = tree_sent = max(record + chain + link, stage0_free) + tree_pass  # the tree of step k + 2
        record = max(arrives, record + chain) + stage1
    return record / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--link-ms", type=float, default=12.0,
                        help="L: one way, with sending and receiving (default 12)")
    parser.add_argument("--stage0-ms", type=float, default=9.2, help="T0: stage 0's pass of one row (default 9.2)")
    parser.add_argument("--stage1-ms", type=float, default=17.8,
                        help="S1: the last stage's verify, acceptance and drafts (default 17.8)")
    parser.add_argument("--chain-ms", type=float, default=13.5,
                        help="B: the last stage's chain of a tree's branches after a record (default 13.5)")
    parser.add_argument("--tree-pass-ms", type=float, default=19.5,
                        help="T0w: stage 0's fork, commit and pass over the tree's rows (default 19.5)")
    parser.add_argument("--far-step-ms", type=float, default=24.4,
                        help="one far worker's step, for the ratio (default 24.4: 103.4 tokens/s at MAL 2.52)")
    parser.add_argument("--held", type=float, nargs="+", default=[0.0, 0.5, 0.62, 0.73, 1.0],
                        help="the shares of trees that hold (default 0 0.5 0.62 0.73 1)")
    args = parser.parse_args()
    if min(args.held) < 0 or max(args.held) > 1:
        parser.error("--held takes shares between 0 and 1")
    print("| trees held | ms a step | far worker's step ÷ it | free branches (B = 0, T0w = T0): ms | ÷ |")
    print("|---|---|---|---|---|")
    for held in args.held:
        ms = step_ms(held, args.link_ms, args.stage0_ms, args.stage1_ms, args.chain_ms, args.tree_pass_ms)
        free = step_ms(held, args.link_ms, args.stage0_ms, args.stage1_ms, 0.0, args.stage0_ms)
        print(f"| {held:.0%} | {ms:.1f} | {args.far_step_ms / ms:.2f}× | {free:.1f} | {args.far_step_ms / free:.2f}× |")


if __name__ == "__main__":
    main()
