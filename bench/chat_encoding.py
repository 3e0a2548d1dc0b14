"""A conversation's next turn through the server's chat encoder: its prompt tokenized whole (what every
turn cost before pieces were kept) against tokenized after the turn before (server.encoding.ChatEncoder).

    python bench/chat_encoding.py [--system-words 3000] [--repeats 20]

Qwen3.5's chat template and added tokens (the test chat model's tokenizer, shardspec.testing.chat_model),
a system prompt of --system-words words of the bundled model's card, one user turn, an assistant reply
and a second user turn; best of --repeats, on this machine's CPU, one thread of tokenization.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from shardspec.cli import BUNDLED_MODEL
from shardspec.orchestrator.tokenizer import Tokenizer
from shardspec.server.chat import ChatTemplate
from shardspec.server.encoding import ChatEncoder, encode_within
from shardspec.testing.chat_model import CHAT_TEMPLATE, chat_tokenizer


def best_ms(work, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return 1e3 * min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system-words", type=int, default=3000, help="words of the system prompt (default 3000)")
    parser.add_argument("--repeats", type=int, default=20, help="timed runs, the best reported (default 20)")
    args = parser.parse_args()
    if args.system_words < 1 or args.repeats < 1:
        parser.error("--system-words and --repeats take a positive count")
    tokenizer = Tokenizer(HFTokenizer.from_str(json.dumps(chat_tokenizer())))
    chat = ChatTemplate(CHAT_TEMPLATE, {"eos_token": "<|im_end|>"})
    added = {t.content for t in tokenizer.inner.get_added_tokens_decoder().values()}
    words = (Path(BUNDLED_MODEL) / "README.md").read_text().split()
    rng = random.Random(0)
    system = " ".join(rng.choice(words) for _ in range(args.system_words))
    turn_1 = [{"role": "system", "content": system},
              {"role": "user", "content": "How do I list the files of a folder, hidden ones too?"}]
    turn_2 = [*turn_1, {"role": "assistant", "content": "Use ls -a in that folder."},
              {"role": "user", "content": "And sorted by their size?"}]
    first, second = (chat.render_request(messages, None, None, added) for messages in (turn_1, turn_2))
    limit = 10**7
    tokens = len(encode_within(tokenizer, second.marked, limit))

    def after_the_turn_before() -> float:
        encoder = ChatEncoder(tokenizer)
        encoder.encode(first, limit)
        return best_ms(lambda: encoder.encode(second, limit), 1)

    whole = best_ms(lambda: encode_within(tokenizer, second.marked, limit), args.repeats)
    kept = min(after_the_turn_before() for _ in range(args.repeats))
    print(f"second turn, {tokens:,} tokens: whole {whole:.2f} ms, after the turn before {kept:.3f} ms "
          f"({whole / kept:.0f}x)")


if __name__ == "__main__":
    main()
