"""The command line: the subcommands and their flags (the worker options' flags generated from
`WorkerOptions`, by option_flags)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from shardspec.option_flags import add_flags
from shardspec.orchestrator.config import (
    BUNDLED_MODEL,
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_DIST_TIMEOUT_S,
    DEFAULT_DRAFT_TOKENS,
    FORCED_ACCEPTANCE_ENV,
)
from shardspec.protocol.messages import LOOKAHEAD_MODES, MAX_STEP_PROMPT_TOKENS, WorkerOptions
from shardspec.protocol.transport import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DEFAULT_LEASE_S,
    DEFAULT_MAX_MESSAGE_BYTES,
    KEEPALIVE_S,
    REFUSED_GRACE_S,
)
from shardspec.utils import parse_size

# generate's when it samples (chosen on held-out signatures: tools/eval_tiny.py --dev); greedy output
# (--temperature 0) is the model's own argmax unless asked; the server's default is always 1, as vLLM's
DEFAULT_REPETITION_PENALTY = 1.05

EXAMPLES = """\
examples:
  shardspec generate "def fibonacci(n):" --model DIR --local 2
  shardspec generate --model DIR --prompt-ids 1,2,3 --max-tokens 16 --json
  shardspec worker --listen tcp://0.0.0.0:7000 --device cuda:0
  shardspec generate "Hello" --model DIR --workers tcp://hostA:7000,tcp://hostB:7000
  shardspec serve --model DIR --port 8000
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardspec",
        description="Run Qwen3.5-style MTP language models tensor-parallel over shard-worker daemons.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    worker = commands.add_parser(
        "worker",
        help="run a shard-worker daemon on one device",
        description="A long-running daemon that holds one tensor-parallel shard of a model. It serves one "
        "orchestrator at a time and returns to idle when that orchestrator leaves; SIGINT/SIGTERM stop it.",
    )
    worker.add_argument("--listen", required=True, metavar="ADDR", help="tcp://HOST:PORT or ipc://PATH")
    worker.add_argument("--device", default="cpu", metavar="DEV", help="cpu, cuda or cuda:N (default: cpu)")
    worker.add_argument("--threads", type=int, default=None, metavar="N",
                        help="CPU threads for torch (default: the cores this process may use, divided by the ranks "
                        "of its group on this host, set when a group forms)")
    worker.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="what the worker logs (default INFO)")
    worker.add_argument("--keys", metavar="DIR_OR_FILE", help="this worker's CURVE key pair (folder or .key_secret "
                        "file, from `shardspec keys generate`): tcp:// traffic is then authenticated and encrypted "
                        "(default: none, only ipc:// and, with --insecure, plain tcp://)")
    worker.add_argument("--allow", metavar="KEY_FILE_OR_DIR", action="append", default=[],
                        help="public key(s) of orchestrators this worker accepts (repeatable); needs --keys "
                             "(default: none)")
    worker.add_argument("--insecure", action="store_true",
                        help="allow listening on tcp:// (loopback too) or abstract ipc://@NAME without keys: anyone "
                        "who reaches the address can use, crash or stop the worker. A filesystem ipc:// socket needs "
                        "neither: it is made owner-only")
    _add_heartbeat_option(worker, "the stage links between pipeline stages count a peer worker that stopped "
                          "answering as lost after this many seconds (an orchestrator's own --heartbeat-timeout "
                          "decides when the worker drops that orchestrator)")
    worker.add_argument("--lease", type=float, default=DEFAULT_LEASE_S, metavar="S",
                        help="an orchestrator that sends nothing for S seconds loses this worker, which goes back to "
                        f"idle (orchestrators renew it with a hello every {KEEPALIVE_S:g}s of quiet; default "
                        f"{DEFAULT_LEASE_S:g})")
    worker.add_argument("--max-message-mb", type=float, default=DEFAULT_MAX_MESSAGE_BYTES / 2**20, metavar="MB",
                        help="a peer that sends a larger frame is disconnected (default "
                        f"{DEFAULT_MAX_MESSAGE_BYTES / 2**20:g}: a step's prompts of "
                        f"{MAX_STEP_PROMPT_TOKENS} tokens)")

    _add_cache_options(worker)

    status = commands.add_parser(
        "status", help="ask worker daemons what they are doing, without taking them over",
        description="Ask each worker daemon at ADDR for its state: idle, initialized, loading (how far) or loaded; "
        "its owner's address, the model folder's name, stage and layers it holds, memory, version and uptime. "
        "The workers are not taken over: this works while an orchestrator uses them. A worker with CURVE keys "
        "answers only peers it allows. Exits 1 if any worker did not answer.")
    status.add_argument("addresses", nargs="+", metavar="ADDR", help="worker addresses (tcp://HOST:PORT or "
                        "ipc://PATH)")
    status.add_argument("--keys", metavar="DIR_OR_FILE", help="this client's CURVE key pair, for workers with "
                        "keys (default: none, plain connections)")
    status.add_argument("--server-keys", metavar="DIR_OR_FILE", help="the workers' public key(s): one .key for "
                        "all, or a folder with one per address, taken in the order of their file names for the "
                        "addresses in order (default: none; needed with --keys)")
    status.add_argument("--timeout", type=float, default=10.0, metavar="S",
                        help="give up on a worker that has not answered after this many seconds (default 10)")
    status.add_argument("--json", action="store_true", help="print one JSON object per worker instead of a table")

    keys = commands.add_parser("keys", help="make CURVE key pairs for workers and orchestrators",
                               description="CURVE key pairs in ZeroMQ's certificate format.")
    key_commands = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    make = key_commands.add_parser("generate", help="write NAME.key (public) and NAME.key_secret into DIR")
    make.add_argument("dir", metavar="DIR", help="the folder of the pair, made (0700) if it is missing")
    make.add_argument("--name", default="shardspec",
                      help="file name of the pair: letters, digits, '.', '_' or '-' (default: shardspec)")

    gen = commands.add_parser(
        "generate",
        help="generate a completion for one prompt",
        description="Load a model on local or remote workers and stream the completion of one prompt.",
    )
    gen.add_argument("prompt", nargs="?", help="prompt text (needs the model's tokenizer.json)")
    gen.add_argument("--prompt-ids", metavar="IDS",
                     help="comma-separated token ids instead of text (default: the PROMPT text)")
    _add_model_options(gen)
    gen.add_argument("--max-tokens", type=int, default=128, metavar="N",
                     help="tokens to generate at most (default 128)")
    gen.add_argument("--temperature", type=float, default=0.8, metavar="T",
                     help="sampling temperature (default 0.8); 0 = greedy, deterministic")
    gen.add_argument("--top-k", type=int, default=40, metavar="K", help="keep the K most likely tokens (default 40; "
                     "0 = all)")
    gen.add_argument("--top-p", type=float, default=0.95, metavar="P", help="nucleus sampling mass (default 0.95)")
    gen.add_argument("--seed", type=int, default=None, metavar="S",
                     help="sampling seed, for a reproducible completion (default: a random one)")
    gen.add_argument("--repetition-penalty", type=float, default=None, metavar="R",
                     help="divide the positive logits (multiply the negative) of every token already in the prompt "
                          f"or the output by R (default {DEFAULT_REPETITION_PENALTY} when sampling, 1 = off with "
                          "--temperature 0)")
    gen.add_argument("--presence-penalty", type=float, default=0.0, metavar="P",
                     help="subtract P from the logit of every token already in the output (default 0)")
    gen.add_argument("--frequency-penalty", type=float, default=0.0, metavar="F",
                     help="subtract F times its count in the output from each token's logit (default 0)")
    _add_decoding_options(gen)
    gen.add_argument("--no-pipeline", action="store_true",
                     help="wait for each step's reply before sending the next (default: the next step is sent "
                          "while the workers run this one)")
    gen.add_argument("--forced-acceptance", type=float, default=None, metavar="P",
                     help=f"BENCHMARKS ONLY: accept each draft with probability P whatever the model says; "
                          f"changes the output; needs {FORCED_ACCEPTANCE_ENV}=1 (default: off)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                     help="what the orchestrator logs (default WARNING)")
    _add_serve_parser(commands)
    return parser


def _add_model_options(parser: argparse.ArgumentParser,
                       dtype_help: str = "default auto: the checkpoint's dtype on CPU, bfloat16 on GPU") -> None:
    """Which model, on which workers, in which dtype: shared by generate and serve."""
    parser.add_argument("--model", metavar="DIR|ORG/NAME[@REV]", default=str(BUNDLED_MODEL),
                        help="a Hugging Face-style model folder, or a Hub id fetched with huggingface_hub (its cache, "
                        "HF_TOKEN, HF_HUB_OFFLINE; the revision, default main, pinned to its commit): this side "
                        "fetches config and tokenizer, each worker only the safetensors files of its layers. A path "
                        "that exists here is a folder even where it reads as ORG/NAME; any other ORG/NAME is a Hub id. "
                        "Workers without the model receive their tensors from "
                        "this side (default: the bundled tiny Python-code model)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--local", type=int, metavar="N",
                       help="spawn N workers on this machine (default: 2; on a GPU machine, one per GPU up to 2)")
    where.add_argument("--workers", metavar="A,B,...", help="addresses of running workers, rank order "
                       "(default: spawn --local workers)")
    parser.add_argument("--tp", type=int, metavar="N", help="tensor-parallel degree of each stage (default: the "
                        "workers ÷ --pp)")
    parser.add_argument("--ep", type=int, default=1, metavar="E",
                        help="expert parallelism of mixture-of-experts models (default 1): each stage's --tp ranks "
                        "form E groups, each holding 1/E of the experts whole, each expert split over its group's "
                        "ranks; E must divide --tp and the expert count (E = --tp: whole experts per rank)")
    parser.add_argument("--pp", type=int, default=1, metavar="P",
                        help="pipeline stages (default 1): the workers, in rank order, form P stages of --tp ranks "
                        "each, stage 0's first; give P×T addresses with --workers, or --local P×T. Stages send each "
                        "other hidden states directly, so stages can sit on different hosts")
    parser.add_argument("--layer-split", metavar="N0,N1,...", help="decoder layers per stage, in stage order, summing "
                        "to the model's layers (default: as even as can be; for GPUs of different sizes)")
    relay = parser.add_mutually_exclusive_group()
    relay.add_argument("--relay", action="store_const", const=True, dest="relay",
                       help="send the stages' hidden states through the orchestrator (for hosts that reach it but "
                       "not each other; default: worker to worker, relayed only where a direct link cannot open)")
    relay.add_argument("--no-relay", action="store_const", const=False, dest="relay",
                       help="worker to worker only: fail when a direct stage link cannot open")
    parser.add_argument("--micro-batches", type=int, metavar="M", help="split the running sequences into M "
                        "micro-batches stepped in turn, so that every stage has work while the others run "
                        "(default: --pp, at most the batch)")
    parser.add_argument("--lookahead", choices=LOOKAHEAD_MODES, default="auto", help="with --pp and MTP, "
                        "while a sequence decoding alone waits for its step's result, the earlier stages run its "
                        "next step on the last stage's guess and again if the guess was wrong (CPU workers): "
                        "auto guesses for the first 16 guesses, then while at least 5%% of the last 64 held (and "
                        "at one step in 16 otherwise), on always, off never; tree: the earlier stages run the "
                        "next step for several outcomes of the step in flight at once, as a tree of branches "
                        "(default: auto)")
    parser.add_argument("--tree-width", type=int, default=0, metavar="N", help="with --lookahead tree: the "
                        "branches of each guess, at most 64 / (draft tokens + 1) and 16 (default 0: adaptive, the "
                        "width whose lone steps made the most tokens a second, measured in turn with none, 2, 4, "
                        "8 and 16)")
    parser.add_argument("--device", default=None, help="device of spawned local workers: cpu or cuda "
                        "(default: cuda when this machine has a GPU)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help=dtype_help)
    parser.add_argument("--keys", metavar="DIR_OR_FILE", help="this orchestrator's CURVE key pair (for tcp:// workers; "
                        "default: none, plain connections)")
    parser.add_argument("--server-keys", metavar="DIR_OR_FILE",
                        help="the workers' public key(s): one .key for all, or a folder with one per worker, "
                             "taken in the order of their file names for the workers in address order (default: "
                             "none; needed with --keys)")
    _add_heartbeat_option(parser, "a worker that exited or stopped answering is declared lost after this many "
                          "seconds: its requests fail, and the orchestrator reconnects until it is back")
    parser.add_argument("--dist-timeout", type=float, default=DEFAULT_DIST_TIMEOUT_S, metavar="S",
                        help="a worker's collective that waits this long for a stuck peer fails, and the workers go "
                        f"back to idle (default {DEFAULT_DIST_TIMEOUT_S:g})")
    parser.add_argument("--dist-port", type=int, default=None, metavar="PORT",
                        help="port of the workers' process-group rendezvous, on rank 0's host (default: the first "
                        "port above rank 0's that no worker listens on; a free one for spawned workers)")
    parser.add_argument("--connect-timeout", type=float, default=DEFAULT_CONNECT_TIMEOUT_S, metavar="S",
                        help="give up when a worker has not answered hello within S seconds (default "
                        f"{DEFAULT_CONNECT_TIMEOUT_S:g}); a worker address that refuses connections fails after "
                        f"{REFUSED_GRACE_S:g}s")
    parser.add_argument("--step-timeout", type=float, default=0.0, metavar="S",
                        help="a step whose reply a worker has not sent after this many seconds fails, naming the "
                        "worker, and the orchestrator reconnects as for a lost one (catches a worker hung while its "
                        "heartbeats still flow; default 0: derived from the step's tokens and the measured step "
                        "times, at least 30)")
    add_flags(parser, WorkerOptions, "worker options", "How the workers compute; sent to every worker when "
              "the group forms (a worker needs none of them set where it runs).")


def _add_cache_options(worker: argparse.ArgumentParser) -> None:
    from shardspec.shard_worker.shard_cache import DEFAULT_CACHE_SIZE, default_cache_dir

    group = worker.add_argument_group(
        "models", "A load names a model folder or a Hub id (ORG/NAME@COMMIT). The worker reads the folder at that "
        "path on its host if there is one; else the shard cache, where an orchestrator's transfers are kept; else "
        "it fetches from the Hugging Face Hub only the safetensors files that hold its stage (huggingface_hub: "
        "HF_HOME, HF_TOKEN, HF_HUB_OFFLINE); where it has none of these, the orchestrator sends its stage's "
        "tensors over this worker's socket (CURVE with keys), each checked by sha256, into the shard cache.")
    group.add_argument("--cache-dir", type=Path, default=None, metavar="DIR",
                       help=f"the shard cache: tensors received from orchestrators, one file per tensor named by "
                       f"its sha256, so the next load of the same model reads them from disk; a transfer that "
                       f"stopped resumes from what is there (default: {default_cache_dir()})")
    group.add_argument("--cache-size", type=size, default=DEFAULT_CACHE_SIZE, metavar="SIZE",
                       help="the most the shard cache holds, e.g. 50GiB; past it the least recently used tensors "
                       "are deleted, and a stage larger than it fails its load (default "
                       f"{DEFAULT_CACHE_SIZE >> 30}GiB)")
    group.add_argument("--model-dir", type=Path, default=None, metavar="DIR",
                       help="read model folders only under DIR; a path outside it counts as absent, so the model "
                       "comes from the cache, the Hub or the orchestrator (default: any path an orchestrator names)")


def _add_heartbeat_option(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--heartbeat-timeout", type=float, default=DEFAULT_HEARTBEAT_TIMEOUT_S, metavar="S",
                        help=f"{what} (default {DEFAULT_HEARTBEAT_TIMEOUT_S:g})")


def size(text: str) -> int:
    """An argparse type: a size such as 16MiB or 2GiB, in bytes."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_decoding_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-seq-len", type=int, default=None, metavar="N",
                        help="the most tokens of a sequence, prompt and output (default: the model's context, "
                             "max_position_embeddings; a larger value is capped there, with a warning)")
    parser.add_argument("--cache-memory", type=size, default=None, metavar="SIZE",
                        help="each worker's cache: K/V blocks and the recurrent states of the sequences at once, "
                             "e.g. 512MiB or 2GiB (default: 90%% of a GPU less its weights and 1 GiB kept for CUDA "
                             "graphs; 1 GiB on a CPU). A worker takes no more than its sequences at full length "
                             "can use; too little for one sequence of --max-seq-len is an error at load")
    parser.add_argument("--no-prefix-cache", action="store_true",
                        help="prefill every prompt whole (default: reuse the K/V blocks and recurrent states a prompt "
                             "shares with earlier prompts and outputs; the saved states take at most 1/8 of "
                             "--cache-memory past the sequences' own)")
    parser.add_argument("--no-mtp", action="store_true",
                        help="plain decoding (default: speculative decoding with the model's MTP head, if it has one)")
    parser.add_argument("--draft-tokens", type=int, default=None, metavar="K",
                        help=f"MTP drafts verified per step (default {DEFAULT_DRAFT_TOKENS})")
    parser.add_argument("--deterministic", action="store_true",
                        help="batch-invariant decoding: a request's greedy output is the same whatever else runs "
                        "with it and with MTP on or off, also in bfloat16 (costs throughput; default off)")
    _add_grammar_options(parser)


def _add_grammar_options(parser: argparse.ArgumentParser) -> None:
    """Structured output's bounds (docs/architecture.md, "Structured output"): a constraint is compiled in
    a compile process of its own before its request is queued."""
    group = parser.add_argument_group("structured output", "A constraint (a JSON schema, regex, choice or grammar) "
                                      "is compiled and checked in a compile process before its request is queued; "
                                      "one that crashes it, or passes these bounds, is refused.")
    group.add_argument("--grammar-compilers", type=int, default=2, metavar="N",
                       help="compile processes at once, at the lowest CPU priority (default 2; more constraints "
                       "wait; compiled ones are remembered)")
    group.add_argument("--grammar-timeout", type=float, default=10.0, metavar="S",
                       help="CPU seconds a constraint may take to compile (default 10; ten times that in wall "
                       "time on a busy host)")
    group.add_argument("--grammar-memory", type=size, default="2GiB", metavar="SIZE",
                       help="address space of each compile process (default 2GiB)")
    group.add_argument("--grammar-budget", type=float, default=0.2, metavar="S",
                       help="seconds a sequence's grammar masks may take in one step on the workers; over it the "
                       "sequence fails alone, and a constraint whose first mask takes over a quarter of it is "
                       "refused up front (default 0.2)")


def _add_serve_parser(commands: Any) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        description="Load a model on local or remote workers and serve /v1/completions, /v1/chat/completions, "
        "/v1/responses, /v1/messages (streamed as server-sent events or not), /tokenize, /detokenize, /v1/models, "
        "/health, /metrics and the /status page. Concurrent requests share the steps (continuous batching). "
        "SIGINT/SIGTERM stop the server (after --shutdown-timeout) and shut the workers down.",
    )
    _add_model_options(serve, "default: float32 for local CPU workers (a request's greedy output then does not "
                       "depend on what else is in the batch, and on CPU it is not slower than bfloat16), else auto "
                       "(the checkpoint's dtype on CPU, bfloat16 on GPU)")
    serve.set_defaults(dtype=None)
    _add_decoding_options(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 = any free port)")
    serve.add_argument("--max-seqs", type=int, default=64, metavar="N",
                       help="sequences generated at once (default 64), each with a recurrent state in the cache; "
                       "more requests wait, as they do for K/V blocks")
    serve.add_argument("--served-model-name", metavar="NAME", default=None,
                       help="the model id clients send (default: the model folder's name)")
    serve.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                       help="what the server and orchestrator log (default INFO)")
    _add_cache_salt_option(serve)
    _add_http_limit_options(serve)


def _add_cache_salt_option(serve: Any) -> None:
    from shardspec.server.cache_salts import CACHE_SALT_MODES

    serve.add_argument("--cache-salt", choices=CACHE_SALT_MODES, default="optional",
                       help="which requests share the prefix cache (a request that finds another's prompt cached "
                       "learns it was sent, from cached_tokens and its time to first token). optional: requests "
                       "with the same cache_salt share, and those without one share the common pool; required: a "
                       "request without cache_salt gets 400; from-key: the salt is a keyed hash of the request's "
                       "Authorization: Bearer key (never the key itself): requests share only with those of the "
                       "same key, one without a key gets 401, one that sends cache_salt 400 (the server does not "
                       "check keys: an authenticating proxy in front does). Cached blocks are evicted first from "
                       "the salt that holds the most, so a client flooding the cache evicts its own "
                       "(default: optional)")


def _add_http_limit_options(serve: Any) -> None:
    from shardspec.server.limits import (
        DEFAULT_MAX_BODY_BYTES,
        DEFAULT_MAX_CONNECTIONS,
        DEFAULT_MAX_LOGPROB_ENTRIES,
        DEFAULT_READ_TIMEOUT_S,
        DEFAULT_SHUTDOWN_TIMEOUT_S,
        DEFAULT_WRITE_TIMEOUT_S,
    )

    serve.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="N",
                       help=f"largest request body accepted (default {DEFAULT_MAX_BODY_BYTES}); a larger one gets 413")
    serve.add_argument("--read-timeout", type=float, default=DEFAULT_READ_TIMEOUT_S, metavar="SECONDS",
                       help=f"a request's headers, and then its body, must arrive within this time (default "
                            f"{DEFAULT_READ_TIMEOUT_S:g}); a slower client's connection is closed")
    serve.add_argument("--write-timeout", type=float, default=DEFAULT_WRITE_TIMEOUT_S, metavar="SECONDS",
                       help=f"a client that stops reading its response for this long (default "
                            f"{DEFAULT_WRITE_TIMEOUT_S:g}) is disconnected and its generation cancelled")
    serve.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S, metavar="SECONDS",
                       help=f"on SIGINT or SIGTERM, requests in flight get this long to finish (default "
                            f"{DEFAULT_SHUTDOWN_TIMEOUT_S:g}); those still running then end with an error (a "
                            "stream's error event, a 503); a second signal ends them at once")
    serve.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS, metavar="N",
                       help=f"open connections at most (default {DEFAULT_MAX_CONNECTIONS}); beyond it requests get 503")
    serve.add_argument("--max-logprob-entries", type=int, default=DEFAULT_MAX_LOGPROB_ENTRIES, metavar="N",
                       help=f"log-probabilities one response may hold: choices (n x prompts) x tokens (an echoed "
                       f"prompt's, then max_tokens, or the rest of the context when it is not given) x (logprobs or "
                       f"top_logprobs + 1) (default {DEFAULT_MAX_LOGPROB_ENTRIES:,}); a request that could get more "
                       "is refused with 400 before any work")

