"""What each subcommand does with its parsed arguments; bad input raises UsageError."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from typing import Any

from shardspec.cli.load_display import LoadDisplay
from shardspec.cli.parser import DEFAULT_REPETITION_PENALTY
from shardspec.option_flags import from_flags
from shardspec.orchestrator.config import BUNDLED_MODEL, DEFAULT_DRAFT_TOKENS, EngineConfig
from shardspec.protocol.messages import WorkerOptions
from shardspec.protocol.transport import (
    HEARTBEAT_TIMEOUT_RANGE,
    LEASE_RANGE,
    MAX_MESSAGE_BYTES_RANGE,
    check_heartbeat_timeout,
    check_range,
)


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit code 2."""


class ReaderLeft(Exception):
    """The reader of stdout went away (`shardspec generate ... | head`)."""


def write_out(text: str, end: str = "\n") -> None:
    """`text` on stdout at once. A reader that left raises ReaderLeft: main tells it from a
    BrokenPipeError of the engine's own pipes and sockets."""
    try:
        print(text, end=end, flush=True)
    except BrokenPipeError:
        raise ReaderLeft from None


MAX_THREADS_PER_CORE = 4  # a worker's --threads at most (torch aborts the process past what it can start)


def progress(message: str) -> None:
    print(f"[shardspec] {message}", file=sys.stderr, flush=True)


def worker_labels(config: Any) -> list[str]:
    """How the load's progress names each worker: its address, or its number when spawned here."""
    from shardspec.utils import public

    return [public(a) for a in config.workers] if config.workers else [f"worker {i}" for i in range(config.world_size)]


def _local_defaults(args: argparse.Namespace, workers: list[str] | None) -> tuple[str, int | None]:
    """Device and worker count for spawned workers: the GPUs when there are some, else 2 CPU workers."""
    if workers is not None:
        return args.device or "cpu", None
    import torch

    from shardspec.utils import default_device

    device = args.device or default_device()
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    if args.local is not None:
        return device, args.local
    if args.pp > 1:  # one worker per stage unless --tp says more
        return device, (args.tp or 1) * args.pp
    return device, args.tp or (max(1, min(gpus, 2)) if device == "cuda" else 2)


def engine_config(args: argparse.Namespace, **options: Any) -> EngineConfig:
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
            tree_width=args.tree_width,
            dtype=dtype,
            max_seq_len=args.max_seq_len, cache_memory=args.cache_memory, prefix_cache=not args.no_prefix_cache,
            mtp=False if args.no_mtp else None,
            draft_tokens=DEFAULT_DRAFT_TOKENS if args.draft_tokens is None else args.draft_tokens,
            keys=args.keys, server_keys=args.server_keys, heartbeat_timeout=args.heartbeat_timeout,
            dist_timeout=args.dist_timeout, dist_port=args.dist_port, connect_timeout=args.connect_timeout,
            step_timeout=args.step_timeout, deterministic=args.deterministic,
            grammar_compilers=args.grammar_compilers, grammar_timeout=args.grammar_timeout,
            grammar_memory=args.grammar_memory, grammar_budget=args.grammar_budget,
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
    from shardspec.shard_worker.shard_cache import ShardCache
    from shardspec.utils import check_address, parse_device, setup_logging

    try:
        check_address(args.listen)
        parse_device(args.device)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    _check_heartbeat(args)
    max_message_bytes = _check_worker_limits(args)
    keys, allow = _worker_keys(args)
    if args.cache_dir is not None and args.cache_dir.exists() and not args.cache_dir.is_dir():
        raise UsageError(f"--cache-dir must be a folder (or a path to make one), got {args.cache_dir}")
    if args.threads is not None:  # (last: a thread count torch cannot start aborts the process)
        most = MAX_THREADS_PER_CORE * (os.cpu_count() or 1)
        if not 1 <= args.threads <= most:
            raise UsageError(f"--threads must be in [1, {most}] ({MAX_THREADS_PER_CORE} per core), got {args.threads}")
        torch.set_num_threads(args.threads)
    setup_logging(f"worker[{args.listen}]", args.log_level)
    if args.model_dir is not None and not args.model_dir.is_dir():
        logging.getLogger("shardspec.worker").warning("--model-dir %s is no folder: this worker reads no model "
                                                      "folder, its models come from its cache or over the network",
                                                      args.model_dir)
    if args.insecure and keys is None:
        logging.getLogger("shardspec.worker").warning("INSECURE: no CURVE keys; anyone who reaches %s can use "
                                                      "this worker", args.listen)
    try:
        cache = ShardCache(args.cache_dir, args.cache_size, tag=args.listen)
    except OSError as exc:
        raise UsageError(f"--cache-dir {exc.filename or args.cache_dir}: cannot make or use it: "
                         f"{exc.strerror or exc}") from None
    try:
        ShardWorker(args.listen, args.device, keys, allow, args.heartbeat_timeout, args.lease,
                    max_message_bytes, args.threads, cache, args.model_dir).serve_forever()
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
    write_out(f"wrote {public} (public: give it to peers) and {secret} (secret: keep it here)")
    return 0


async def run_status(args: argparse.Namespace) -> int:
    """Each worker's state, one line each (or JSON), without taking any over."""
    from dataclasses import asdict

    from shardspec import security
    from shardspec.orchestrator.workers import printable, worker_status
    from shardspec.protocol.errors import RemoteError
    from shardspec.protocol.transport import check_range
    from shardspec.utils import check_address

    try:
        check_range("--timeout", args.timeout, 0.1, 3600.0)
        for address in args.addresses:
            check_address(address)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if (args.keys is None) != (args.server_keys is None):
        raise UsageError("give --keys and --server-keys together (CURVE), or neither")
    pair, publics = None, [None]
    if args.keys is not None:
        try:
            pair, publics = security.load_pair(args.keys), security.load_public_keys(args.server_keys)
        except security.KeyFileError as exc:
            raise UsageError(str(exc)) from None
        if len(publics) not in (1, len(args.addresses)):
            raise UsageError(f"--server-keys holds {len(publics)} public keys for {len(args.addresses)} addresses: "
                             "give one, or one per address")
    answers = await asyncio.gather(*(worker_status(address, pair, publics[i % len(publics)], args.timeout)
                                     for i, address in enumerate(args.addresses)), return_exceptions=True)
    failed = 0
    for address, answer in zip(args.addresses, answers, strict=True):
        if isinstance(answer, BaseException) and not isinstance(answer, Exception):
            raise answer
        if isinstance(answer, Exception):
            failed += 1
            reason = answer.message if isinstance(answer, RemoteError) else str(answer)
            write_out(json.dumps({"address": address, "error": reason}) if args.json
                      else printable(f"{address}: error: {reason}"))  # (the worker's text: no escape codes)
        else:
            write_out(json.dumps({"address": address, **asdict(answer)}) if args.json
                      else printable(status_line(address, answer)))
    return 1 if failed else 0


def status_line(address: str, s: Any) -> str:
    """One worker's StatusReply as a line of text."""
    parts = [s.state]
    if s.owner:
        parts.append(f"owned by {s.owner}")
    if s.loading is not None and s.loading.bytes_total:
        parts.append(f"{s.loading.bytes_done / s.loading.bytes_total:.0%} of {s.loading.bytes_total / 1e9:.2f} GB read")
    if s.model:
        where = f"stage {s.stage} of {s.stages}" + (f", layers {s.layers[0]}-{s.layers[1] - 1}"
                                                    if len(s.layers) == 2 else "")
        parts.append(f"{s.model} ({where}, rank {s.rank} of {s.world_size})")
    memory = f"{s.rss_bytes / 1e9:.2f} GB resident" + (f", {s.device_bytes / 1e9:.2f} GB on the device"
                                                       if s.device_bytes else "")
    parts += [f"{s.device} on {s.hostname}", memory, f"shardspec {s.version}", f"up {_duration(s.uptime_s)}"]
    return f"{address}: " + "; ".join(parts)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


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


def _check_sampling(args: argparse.Namespace) -> None:
    """generate's sampling options as a request's are checked, before any worker starts."""
    from shardspec.orchestrator import request_values as values

    penalties = sampling_penalties(args)
    try:
        values.with_penalties(values.sampling(args.temperature, args.top_k, args.top_p, args.seed),
                         penalties["presence_penalty"], penalties["frequency_penalty"], penalties["repetition_penalty"])
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def sampling_penalties(args: argparse.Namespace) -> dict[str, float]:
    """generate's penalty options, as engine.generate takes them."""
    repetition = args.repetition_penalty
    if repetition is None:
        repetition = 1.0 if args.temperature == 0 else DEFAULT_REPETITION_PENALTY
    return {"repetition_penalty": repetition, "presence_penalty": args.presence_penalty,
            "frequency_penalty": args.frequency_penalty}


async def run_generate(args: argparse.Namespace) -> int:
    """`generate`, stopped by SIGINT or SIGTERM: the first shuts the workers down (they leave the
    group, spawned ones stop, their folders go), a second kills the spawned ones at once; then exit
    128 + the signal's number."""
    from shardspec.orchestrator.workers import kill_spawned

    loop, main = asyncio.get_running_loop(), asyncio.current_task()
    assert main is not None
    signals: list[int] = []
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def on_signal(sig: int) -> None:
        signals.append(sig)
        what = "stopping the workers (again to force)" if args.workers is None else "the workers go back to idle"
        print(f"\nshardspec generate: {signal.Signals(sig).name}: {what}", file=sys.stderr, flush=True)
        main.cancel()
        for each in previous:  # (the next one may come while the cleanup blocks the loop, waiting for a
            loop.remove_signal_handler(each)  # worker to exit: a plain handler runs all the same)
            signal.signal(each, lambda *_: kill_spawned())

    for sig in previous:
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        return await _generate(args)
    except asyncio.CancelledError:
        if not signals:
            raise
        print("shardspec generate: interrupted", file=sys.stderr)
        return 128 + signals[0]
    finally:
        for sig, handler in previous.items():
            loop.remove_signal_handler(sig)
            signal.signal(sig, handler)


async def _generate(args: argparse.Namespace) -> int:
    from shardspec.orchestrator.engine import ENGINE_ERRORS, connect
    from shardspec.utils import setup_logging

    setup_logging("orchestrator", args.log_level)
    prompt = _generate_prompt(args)
    _check_sampling(args)
    config = engine_config(args, max_seqs=1, pipeline=not args.no_pipeline, forced_acceptance=args.forced_acceptance)
    token_ids: list[int] = []
    final = None
    try:
        progress(f"starting {'workers' if config.spawns_workers else 'connection'} and loading {args.model}")
        display = LoadDisplay(worker_labels(config))
        try:
            async with connect(config=config, on_progress=display) as engine:
                display.close()
                info, world_size = engine.load_info, config.world_size
                weights = info.weight_bytes * world_size / 1e6
                progress(f"ready{model_note(engine)}: {world_size} workers{collectives_note(engine)}, "
                         f"{weights:.0f} MB of {info.dtype} "
                         f"weights, MTP drafts per step: {info.draft_tokens or 'off'}; {cache_line(engine)}")
                async for chunk in engine.generate(prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                                                   top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                                   **sampling_penalties(args)):
                    token_ids += chunk.token_ids
                    if not args.json:
                        write_out(chunk.text if engine.tokenizer else " ".join(map(str, chunk.token_ids)),
                                  end="" if engine.tokenizer else " ")
                    final = chunk
                text = engine.tokenizer.decode(token_ids) if engine.tokenizer else None
        finally:
            display.close()
    except ValueError as exc:
        raise UsageError(_in_flags(str(exc), args)) from None
    except ENGINE_ERRORS as exc:
        print(f"\nshardspec generate: error: {exc}", file=sys.stderr)
        return 1
    assert final is not None and final.stats is not None
    if args.json:
        out = {"token_ids": token_ids, "finish_reason": final.finish_reason, "stats": final.stats}
        if text is not None:
            out["text"] = text
        write_out(json.dumps(out))
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
    from shardspec.orchestrator.engine import ENGINE_ERRORS
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
    display = LoadDisplay(worker_labels(options.engine))
    try:
        options.engine.check_model_folder()  # before HTTP is served: a bad folder is one clear line
        asyncio.run(serve(options, sock, _serving_line(options.model_name, display.close), on_progress=display))
    except ValueError as exc:
        raise UsageError(_in_flags(str(exc), args)) from None
    except ENGINE_ERRORS as exc:
        print(f"shardspec serve: error: {exc}", file=sys.stderr)
        return 1
    finally:
        display.close()
        sock.close()
    progress("stopped")
    return 0


def _serve_options(args: argparse.Namespace) -> Any:
    from shardspec.server.limits import HttpLimits
    from shardspec.server.run import ServeOptions, default_model_name

    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    try:
        limits = HttpLimits(args.max_body_bytes, args.read_timeout, args.max_connections,
                            args.max_logprob_entries, write_timeout_s=args.write_timeout,
                            shutdown_timeout_s=args.shutdown_timeout)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return ServeOptions(
        engine=engine_config(args, max_seqs=args.max_seqs), host=args.host, port=args.port,
        model_name=args.served_model_name or default_model_name(args.model, BUNDLED_MODEL),
        log_level=args.log_level.lower(), limits=limits, cache_salt=args.cache_salt,
    )


def model_note(engine: Any) -> str:
    """A Hub model's revision, pinned to its commit, for the ready lines ("" for a folder)."""
    hub_model = engine.config.hub_model
    return f" ({hub_model.pinned})" if hub_model is not None else ""


def collectives_note(engine: Any) -> str:
    """How the TP groups' collectives go, for the ready lines ("" without tensor parallelism)."""
    path = engine.group.collectives
    return f" (TP collectives: {path})" if path else ""


def cache_line(engine: Any) -> str:
    """What the workers' caches hold, for the ready lines."""
    paging, info = engine.group.paging, engine.load_info
    prefix = f"{paging.states} saved states" if engine.scheduler.cache.enabled else "off"
    return (f"cache: {paging.positions:,} tokens of K/V in {paging.blocks:,} blocks, up to "
            f"{engine.scheduler.max_seqs} sequence{'s' * (engine.scheduler.max_seqs > 1)} of up to "
            f"{info.max_seq_len:,} tokens, "
            f"{info.cache_bytes / 2**20:,.1f} MiB a worker; prefix cache: {prefix}")


def _serving_line(name: str, loaded: Any) -> Any:
    def ready(url: str, engine: Any) -> None:
        loaded()
        info = engine.load_info
        progress(f"serving {name}{model_note(engine)} at {url} ({engine.config.world_size} workers"
                 f"{collectives_note(engine)}, "
                 f"{info.dtype}, MTP drafts per step: {info.draft_tokens or 'off'}; {cache_line(engine)})")

    return ready
