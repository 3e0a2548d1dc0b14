"""The `shardspec` command: `worker` runs a shard-worker daemon, `generate` runs one prompt, `serve`
runs an OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from typing import Any

from shardspec.option_flags import add_flags, from_flags
from shardspec.orchestrator.config import (
    BUNDLED_MODEL,
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_DIST_TIMEOUT_S,
    DEFAULT_DRAFT_TOKENS,
    FORCED_ACCEPTANCE_ENV,
    EngineConfig,
)
from shardspec.protocol.messages import LOOKAHEAD_MODES, MAX_STEP_PROMPT_TOKENS, WorkerOptions
from shardspec.protocol.transport import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DEFAULT_LEASE_S,
    DEFAULT_MAX_MESSAGE_BYTES,
    HEARTBEAT_TIMEOUT_RANGE,
    KEEPALIVE_S,
    LEASE_RANGE,
    MAX_MESSAGE_BYTES_RANGE,
    REFUSED_GRACE_S,
    check_heartbeat_timeout,
    check_range,
)

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


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit code 2."""


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

    keys = commands.add_parser("keys", help="make CURVE key pairs for workers and orchestrators",
                               description="CURVE key pairs in ZeroMQ's certificate format.")
    key_commands = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    make = key_commands.add_parser("generate", help="write NAME.key (public) and NAME.key_secret into DIR")
    make.add_argument("dir", metavar="DIR")
    make.add_argument("--name", default="shardspec", help="file name of the pair (default: shardspec)")

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
    gen.add_argument("--no-pipeline", action="store_true", help="wait for each step's reply before sending the next")
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
    parser.add_argument("--model", metavar="DIR", default=str(BUNDLED_MODEL),
                        help="Hugging Face-style model folder (default: the bundled tiny Python-code model)")
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
                        "auto guesses while at least half of the recent steps kept all their drafts (a guess "
                        "can hold only then), on always, off never (default: auto)")
    parser.add_argument("--device", default=None, help="device of spawned local workers: cpu or cuda "
                        "(default: cuda when this machine has a GPU)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help=dtype_help)
    parser.add_argument("--keys", metavar="DIR_OR_FILE", help="this orchestrator's CURVE key pair (for tcp:// workers; "
                        "default: none, plain connections)")
    parser.add_argument("--server-keys", metavar="DIR_OR_FILE",
                        help="the workers' public key(s): one .key for all, or a folder with one per worker "
                             "(default: none; needed with --keys)")
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


def _add_heartbeat_option(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--heartbeat-timeout", type=float, default=DEFAULT_HEARTBEAT_TIMEOUT_S, metavar="S",
                        help=f"{what} (default {DEFAULT_HEARTBEAT_TIMEOUT_S:g})")


def _add_decoding_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-seq-len", type=int, default=4096, metavar="N",
                        help="cache length per sequence, prompt and output (default 4096; capped, with a "
                             "warning, at the model's max_position_embeddings)")
    parser.add_argument("--no-mtp", action="store_true",
                        help="plain decoding (default: speculative decoding with the model's MTP head, if it has one)")
    parser.add_argument("--draft-tokens", type=int, default=None, metavar="K",
                        help=f"MTP drafts verified per step (default {DEFAULT_DRAFT_TOKENS})")
    parser.add_argument("--deterministic", action="store_true",
                        help="batch-invariant decoding: a request's greedy output is the same whatever else runs "
                        "with it and with MTP on or off, also in bfloat16 (costs throughput; default off)")


def _add_serve_parser(commands: Any) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        description="Load a model on local or remote workers and serve /v1/completions, /v1/chat/completions "
        "(streamed as server-sent events or not), /v1/models, /health and /metrics. Concurrent requests share "
        "the steps (continuous batching). SIGINT/SIGTERM stop the server and shut the workers down.",
    )
    _add_model_options(serve, "default: float32 for local CPU workers (a request's greedy output then does not "
                       "depend on what else is in the batch, and on CPU it is not slower than bfloat16), else auto "
                       "(the checkpoint's dtype on CPU, bfloat16 on GPU)")
    serve.set_defaults(dtype=None)
    _add_decoding_options(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 = any free port)")
    serve.add_argument("--max-slots", type=int, default=64, metavar="N",
                       help="sequences generated at once (default 64); more requests wait for a free slot")
    serve.add_argument("--served-model-name", metavar="NAME", default=None,
                       help="the model id clients send (default: the model folder's name)")
    serve.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                       help="what the server and orchestrator log (default INFO)")
    _add_http_limit_options(serve)


def _add_http_limit_options(serve: Any) -> None:
    from shardspec.server.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_CONNECTIONS, DEFAULT_READ_TIMEOUT_S

    serve.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="N",
                       help=f"largest request body accepted (default {DEFAULT_MAX_BODY_BYTES}); a larger one gets 413")
    serve.add_argument("--read-timeout", type=float, default=DEFAULT_READ_TIMEOUT_S, metavar="SECONDS",
                       help=f"a request's headers, and then its body, must arrive within this time (default "
                            f"{DEFAULT_READ_TIMEOUT_S:g}); a slower client's connection is closed")
    serve.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS, metavar="N",
                       help=f"open connections at most (default {DEFAULT_MAX_CONNECTIONS}); beyond it requests get 503")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "worker":
            return run_worker(args)
        if args.command == "keys":
            return run_keys(args)
        if args.command == "serve":
            return run_serve(args)
        return asyncio.run(run_generate(args))
    except UsageError as exc:
        print(f"shardspec {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, asyncio.CancelledError):
        print(f"shardspec {args.command}: interrupted", file=sys.stderr)
        return 130


def progress(message: str) -> None:
    print(f"[shardspec] {message}", file=sys.stderr, flush=True)


def _local_defaults(args: argparse.Namespace, workers: list[str] | None) -> tuple[str, int | None]:
    """Device and worker count for spawned workers: the GPUs when there are some, else 2 CPU workers."""
    if workers is not None:
        return args.device or "cpu", None
    import torch

    gpus = torch.cuda.device_count() if args.device in (None, "cuda") else 0
    device = args.device or ("cuda" if gpus else "cpu")
    if args.local is not None:
        return device, args.local
    if args.pp > 1:  # one worker per stage unless --tp says more
        return device, (args.tp or 1) * args.pp
    return device, args.tp or (max(1, min(gpus, 2)) if device == "cuda" else 2)


def _engine_config(args: argparse.Namespace, **options: Any) -> EngineConfig:
    """The engine's config from the model and decoding options of generate and serve, plus `options`."""
    if args.no_mtp and args.draft_tokens is not None:
        raise UsageError("--draft-tokens sets MTP drafts; it cannot go with --no-mtp")
    workers = [w.strip() for w in args.workers.split(",") if w.strip()] if args.workers else None
    try:
        split = [int(n) for n in args.layer_split.split(",")] if args.layer_split else None
    except ValueError:
        raise UsageError(f"--layer-split must be comma-separated layer counts, got {args.layer_split!r}") from None
    device, local = _local_defaults(args, workers)
    dtype = args.dtype or ("float32" if workers is None and device == "cpu" else "auto")  # serve's default
    try:
        return EngineConfig(
            model=args.model, workers=workers, local=local, device=device, tp=args.tp, ep=args.ep, pp=args.pp,
            layer_split=split, micro_batches=args.micro_batches, lookahead=args.lookahead, relay=args.relay,
            dtype=dtype,
            max_seq_len=args.max_seq_len, mtp=False if args.no_mtp else None,
            draft_tokens=DEFAULT_DRAFT_TOKENS if args.draft_tokens is None else args.draft_tokens,
            keys=args.keys, server_keys=args.server_keys, heartbeat_timeout=args.heartbeat_timeout,
            dist_timeout=args.dist_timeout, dist_port=args.dist_port, connect_timeout=args.connect_timeout,
            step_timeout=args.step_timeout, deterministic=args.deterministic,
            worker_options=from_flags(args, WorkerOptions), **options,
        )
    except ValueError as exc:
        raise UsageError(_in_flags(str(exc), args)) from None


def _in_flags(message: str, args: argparse.Namespace) -> str:
    """A config error in the command line's words: a leading field name becomes the flag that sets it."""
    word, space, rest = message.partition(" ")
    name = word.rstrip(":")
    if space and name in vars(args):
        return f"--{name.replace('_', '-')}{word[len(name):]} {rest}"
    return message


def run_worker(args: argparse.Namespace) -> int:
    import torch

    from shardspec.shard_worker.daemon import ShardWorker
    from shardspec.utils import check_address, parse_device, setup_logging

    try:
        check_address(args.listen)
        parse_device(args.device)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.threads is not None:
        if args.threads < 1:
            raise UsageError(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    _check_heartbeat(args)
    max_message_bytes = _check_worker_limits(args)
    keys, allow = _worker_keys(args)
    setup_logging(f"worker[{args.listen}]", args.log_level)
    if args.insecure and keys is None:
        logging.getLogger("shardspec.worker").warning("INSECURE: no CURVE keys; anyone who reaches %s can use "
                                                      "this worker", args.listen)
    try:
        ShardWorker(args.listen, args.device, keys, allow, args.heartbeat_timeout, args.lease,
                    max_message_bytes, args.threads).serve_forever()
    except Exception as exc:  # e.g. the address is in use
        print(f"shardspec worker: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _check_heartbeat(args: argparse.Namespace) -> None:
    try:
        check_heartbeat_timeout(args.heartbeat_timeout)
    except ValueError:
        lo, hi = HEARTBEAT_TIMEOUT_RANGE
        raise UsageError(f"--heartbeat-timeout must be in [{lo:g}, {hi:g}] seconds, "
                         f"got {args.heartbeat_timeout}") from None


def _check_worker_limits(args: argparse.Namespace) -> int:
    """--lease checked; --max-message-mb in bytes."""
    for flag, value, (lo, hi) in (("--lease", args.lease, LEASE_RANGE),
                                  ("--max-message-mb", args.max_message_mb,
                                   [n / 2**20 for n in MAX_MESSAGE_BYTES_RANGE])):
        try:
            check_range(flag, value, lo, hi)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    return round(args.max_message_mb * 2**20)


def _worker_keys(args: argparse.Namespace) -> tuple[Any, list[bytes]]:
    from shardspec import security

    if args.allow and not args.keys:
        raise UsageError("--allow needs --keys (the worker's own key pair)")
    if args.keys is None:
        if security.reaches_other_users(args.listen) and not args.insecure:
            raise UsageError(
                f"refusing to listen on {args.listen} without CURVE keys: other users could use it. Pass --keys "
                "WORKER_DIR --allow ORCHESTRATOR_DIR/NAME.key (make them with `shardspec keys generate DIR --name "
                "NAME`), use a filesystem ipc://PATH socket, or pass --insecure"
            )
        return None, []
    if not args.allow:
        raise UsageError("--keys needs at least one --allow with an orchestrator's public key")
    try:
        return security.load_pair(args.keys), [k for path in args.allow for k in security.load_public_keys(path)]
    except security.KeyFileError as exc:
        raise UsageError(str(exc)) from None


def run_keys(args: argparse.Namespace) -> int:
    from shardspec import security

    try:
        public, secret = security.generate(args.dir, args.name)
    except security.KeyFileError as exc:
        raise UsageError(str(exc)) from None
    print(f"wrote {public} (public: give it to peers) and {secret} (secret: keep it here)")
    return 0


def _generate_prompt(args: argparse.Namespace) -> Any:
    if (args.prompt is None) == (args.prompt_ids is None):
        raise UsageError("give either a PROMPT text or --prompt-ids, exactly one")
    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.prompt_ids is None:
        return args.prompt
    try:
        return [int(x) for x in args.prompt_ids.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None


def sampling_penalties(args: argparse.Namespace) -> dict[str, float]:
    """generate's penalty options, as engine.generate takes them."""
    repetition = args.repetition_penalty
    if repetition is None:
        repetition = 1.0 if args.temperature == 0 else DEFAULT_REPETITION_PENALTY
    return {"repetition_penalty": repetition, "presence_penalty": args.presence_penalty,
            "frequency_penalty": args.frequency_penalty}


async def run_generate(args: argparse.Namespace) -> int:
    from shardspec.orchestrator.engine import EngineError, connect
    from shardspec.orchestrator.workers import WorkerLost
    from shardspec.protocol.errors import RemoteError
    from shardspec.utils import setup_logging

    setup_logging("orchestrator", args.log_level)
    prompt = _generate_prompt(args)
    config = _engine_config(args, max_slots=1, pipeline=not args.no_pipeline, forced_acceptance=args.forced_acceptance)
    token_ids: list[int] = []
    final = None
    try:
        progress(f"starting {'workers' if config.spawns_workers else 'connection'} and loading {args.model}")
        async with connect(config=config) as engine:
            info, world_size = engine.load_info, config.world_size
            progress(f"ready: {world_size} workers, {info.weight_bytes * world_size / 1e6:.0f} MB "
                     f"of {info.dtype} weights, MTP drafts per step: {info.draft_tokens or 'off'}")
            async for chunk in engine.generate(prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                                               top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                               **sampling_penalties(args)):
                token_ids += chunk.token_ids
                if not args.json:
                    print(chunk.text if engine.tokenizer else " ".join(map(str, chunk.token_ids)),
                          end="" if engine.tokenizer else " ", flush=True)
                final = chunk
            text = engine.tokenizer.decode(token_ids) if engine.tokenizer else None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    except (EngineError, WorkerLost, RemoteError) as exc:
        print(f"\nshardspec generate: error: {exc}", file=sys.stderr)
        return 1
    assert final is not None and final.stats is not None
    if args.json:
        out = {"token_ids": token_ids, "finish_reason": final.finish_reason, "stats": final.stats}
        if text is not None:
            out["text"] = text
        print(json.dumps(out))
    else:
        print("\n" + summary_line(final.finish_reason, final.stats), file=sys.stderr)
    return 0


def summary_line(finish_reason: str | None, s: dict[str, Any]) -> str:
    """One line after a streamed completion: tokens, speed, MTP acceptance."""
    parts = [f"{s['generated_tokens']} tokens", f"{s['tokens_per_s']:.1f} tokens/s",
             f"first token {s['time_to_first_token_s']:.2f}s"]
    if "mean_acceptance_length" in s:
        parts.append(f"mean acceptance length {s['mean_acceptance_length']:.2f}")
    else:
        parts.append("MTP off")
    if "forced_acceptance" in s:
        parts.append(f"FORCED ACCEPTANCE {s['forced_acceptance']} (benchmark: not the model's output)")
    return "[" + ", ".join(parts) + f", finish: {finish_reason}]"


def run_serve(args: argparse.Namespace) -> int:
    from shardspec.orchestrator.engine import EngineError
    from shardspec.orchestrator.workers import WorkerLost
    from shardspec.protocol.errors import RemoteError
    from shardspec.server.run import bind, serve
    from shardspec.utils import setup_logging

    options = _serve_options(args)
    setup_logging("server", args.log_level)
    try:
        sock = bind(args.host, args.port)
    except OSError as exc:
        print(f"shardspec serve: error: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}",
              file=sys.stderr)
        return 1
    progress(f"starting {'workers' if options.engine.spawns_workers else 'connection'} and loading {args.model}")
    try:
        asyncio.run(serve(options, sock, _serving_line(options.model_name)))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    except (EngineError, WorkerLost, RemoteError) as exc:
        print(f"shardspec serve: error: {exc}", file=sys.stderr)
        return 1
    finally:
        sock.close()
    progress("stopped")
    return 0


def _serve_options(args: argparse.Namespace) -> Any:
    from shardspec.server.limits import HttpLimits
    from shardspec.server.run import ServeOptions, default_model_name

    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    try:
        limits = HttpLimits(args.max_body_bytes, args.read_timeout, args.max_connections)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return ServeOptions(
        engine=_engine_config(args, max_slots=args.max_slots), host=args.host, port=args.port,
        model_name=args.served_model_name or default_model_name(args.model, BUNDLED_MODEL),
        log_level=args.log_level.lower(), limits=limits,
    )


def _serving_line(name: str) -> Any:
    def ready(url: str, engine: Any) -> None:
        info = engine.load_info
        progress(f"serving {name} at {url} ({engine.config.world_size} workers, {info.dtype}, MTP drafts per step: "
                 f"{info.draft_tokens or 'off'}, {engine.scheduler.max_slots} slots of {info.max_seq_len} tokens)")

    return ready
