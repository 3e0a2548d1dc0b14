"""Workers that lack the model receive it from the orchestrator, across emulated hosts: the time of
the transfer against bytes ÷ link rate, and the next load (from the workers' shard caches) against
a load from a local folder.

    sudo python bench/shard_transfer.py [--size-mb 300] [--rate-mbit 1000] [--delay-ms 1]

Two hosts (tools/hosts.py: network namespaces joined by VDE wirefilter links of `--delay-ms` one way
each, so 2 × that host to host, each link limited to `--rate-mbit` each way). Host 0 runs the
orchestrator, which has a random bf16 checkpoint of about `--size-mb` in 4 safetensors files; host 1
runs two CPU workers (PP = 2) with CURVE keys and empty disks (`--model-dir` where the model is not),
each with its own `--cache-dir`. Rows: (1) first start: the offer, then the transfer of each stage's
tensors (both workers at once over the one link), then the load from the cache; (2) second start:
the load from the cache (nothing sent); (3) the same workers loading a copy of the model from a
folder on host 1 (hard links: the same bytes on disk). Also the raw TCP throughput of the link (two
connections at once, as the transfer has, 128 MiB each), to tell the link's own limit from the
transfer's. Each start generates 8
greedy tokens; the three must agree.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tools"))
from hosts import EmulatedHosts

PORTS = (7000, 7010)
RAW_BYTES = 128 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=300, help="the checkpoint's size, about (default 300)")
    parser.add_argument("--rate-mbit", type=float, default=1000.0, help="each link's rate, each way (default 1000)")
    parser.add_argument("--delay-ms", type=float, default=1.0, help="one way, per link (default 1: 2 ms host to host)")
    parser.add_argument("--device", default="cpu", help="the workers' device (default cpu: the figures are "
                        "the network's and the disk's)")
    parser.add_argument("--loopback", action="store_true", help="no emulated hosts: everything on 127.0.0.1 "
                        "(the transfer's own limit on this machine; needs no root)")
    parser.add_argument("--orchestrate", metavar="JSON", help=argparse.SUPPRESS)  # the run on host 0
    parser.add_argument("--receive", type=int, metavar="PORT", help=argparse.SUPPRESS)  # raw TCP sink on host 1
    parser.add_argument("--send", metavar="HOST:PORT", help=argparse.SUPPRESS)  # raw TCP source on host 0
    args = parser.parse_args()
    if args.orchestrate:
        return print(json.dumps(asyncio.run(orchestrate(**json.loads(args.orchestrate)))), flush=True)
    if args.receive:
        return receive(args.receive)
    if args.send:
        return send(args.send)
    if not args.loopback and (why := EmulatedHosts.missing()) is not None:
        sys.exit(f"skipped: {why} (--loopback runs without)")
    with tempfile.TemporaryDirectory(prefix="shard-transfer-") as tmp:
        run(Path(tmp), args)


def run(tmp: Path, args: argparse.Namespace) -> None:
    model = tmp / "orchestrator" / "model"
    write_model(model, args.size_mb)
    disk = tmp / "host1-disk"  # the workers' only folder: a copy of the model for row (3)
    (disk / "model").mkdir(parents=True)
    for file in model.iterdir():
        os.link(file, disk / "model" / file.name)
    keys = make_keys(tmp / "keys")
    size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    rate = args.rate_mbit * 1e6 / 8
    cores = ["0", "1"] if os.cpu_count() >= 2 else None
    with (Loopback() if args.loopback else EmulatedHosts(2, args.delay_ms, rate=rate, cores=cores)) as hosts:
        raw = raw_throughput(hosts)
        workers = start_workers(hosts, tmp, disk, keys, args.device)
        common = {"workers": workers, "keys": str(keys / "orchestrator"), "server_keys": str(keys / "worker")}
        rows = [orchestrate_on(hosts, model=str(model), **common), orchestrate_on(hosts, model=str(model), **common),
                orchestrate_on(hosts, model=str(disk / "model"), **common)]
    report(rows, size, rate, raw, args)


class Loopback:
    """EmulatedHosts' interface on this host's loopback: both "hosts" are 127.0.0.1."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Loopback:
        return self

    def __exit__(self, *_exc) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(20)

    def address(self, _host: int) -> str:
        return "127.0.0.1"

    def popen(self, _host: int, cmd: list[str], **kwargs) -> subprocess.Popen:
        self.procs.append(subprocess.Popen(cmd, **kwargs))
        return self.procs[-1]

    def wait_listening(self, _host: int, port: int, timeout: float = 120.0) -> None:
        from shardspec.testing.network import wait_listening

        wait_listening(port, timeout=timeout, poll=0.3)


def write_model(folder: Path, size_mb: int) -> None:
    from shardspec.testing.random_checkpoint import tiny_config, write_random_checkpoint

    layers = 8
    hidden = max(256, int((size_mb / 315) ** 0.5 * 1024) // 64 * 64)  # 1024 wide, 8 layers: ~315 MB in bf16
    config = tiny_config(hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers, vocab_size=32000,
                         layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2)
    write_random_checkpoint(folder, config, seed=0, dtype=__import__("torch").bfloat16, shards=4)


def make_keys(folder: Path) -> Path:
    from shardspec import security

    security.generate(folder / "worker", "worker")
    security.generate(folder / "orchestrator", "orchestrator")
    return folder


def start_workers(hosts: EmulatedHosts, tmp: Path, disk: Path, keys: Path, device: str) -> list[str]:
    addresses = []
    for i, port in enumerate(PORTS):
        address = f"tcp://{hosts.address(1)}:{port}"
        log = open(tmp / f"worker{i}.log", "wb")  # noqa: SIM115 (open while the worker runs)
        hosts.popen(1, [sys.executable, "-m", "shardspec", "worker", "--listen", address, "--threads", "1",
                        "--device", device if device == "cpu" or ":" in device else f"{device}:{i}",
                        "--keys", str(keys / "worker"), "--allow", str(keys / "orchestrator" / "orchestrator.key"),
                        "--model-dir", str(disk), "--cache-dir", str(tmp / f"cache{i}")],
                    stdout=log, stderr=subprocess.STDOUT)
        hosts.wait_listening(1, port)
        addresses.append(address)
    return addresses


def orchestrate_on(hosts: EmulatedHosts, **spec) -> dict:
    done = hosts.popen(0, [sys.executable, __file__, "--orchestrate", json.dumps(spec)], stdout=subprocess.PIPE)
    out, _ = done.communicate(timeout=600)
    if done.returncode:
        sys.exit(f"the orchestrator on host 0 failed ({done.returncode})")
    return json.loads(out.decode().strip().splitlines()[-1])


async def orchestrate(model: str, workers: list[str], keys: str, server_keys: str) -> dict:
    """On host 0: one start of the engine; the transfer's and the loads' times."""
    from shardspec.orchestrator.engine import connect

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("shardspec.orchestrator")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    started = time.perf_counter()
    async with connect(model=model, workers=workers, pp=2, keys=keys, server_keys=server_keys,
                       dtype="bfloat16", max_seqs=1, cache_memory="64MiB") as engine:
        ready = time.perf_counter() - started
        tokens = [t async for c in engine.generate([1, 2, 3, 4], max_tokens=8, temperature=0.0) for t in c.token_ids]
        loads = [reply.load_s for reply in engine.group.load_replies]
    offered = next((r.created for r in records if " loads " in r.getMessage()), None)
    sent = next((r for r in records if r.getMessage().startswith("sent ")), None)
    return {"ready_s": ready, "load_s": max(loads), "tokens": tokens,
            "transfer_s": sent.created - offered if sent is not None else 0.0,
            "sent_mb": float(sent.getMessage().split()[1]) if sent is not None else 0.0}


def raw_throughput(hosts: EmulatedHosts, connections: int = len(PORTS)) -> float:
    """Bytes/s of `connections` TCP connections at once from host 0 to host 1 (RAW_BYTES each), as
    many as the transfer has (one per worker)."""
    ports = [7099 - i for i in range(connections)]
    sinks = [hosts.popen(1, [sys.executable, __file__, "--receive", str(port)], stdout=subprocess.PIPE)
             for port in ports]
    for port in ports:
        hosts.wait_listening(1, port)
    senders = [hosts.popen(0, [sys.executable, __file__, "--send", f"{hosts.address(1)}:{port}"]) for port in ports]
    for sender in senders:
        sender.wait(300)
    return sum(float(sink.communicate(timeout=300)[0].decode().strip().splitlines()[-1]) for sink in sinks)


def receive(port: int) -> None:
    """Accept connections until one sends data (wait_listening's probes send none); print its bytes/s."""
    import socket

    with socket.create_server(("0.0.0.0", port)) as server:
        got = 0
        while not got:
            conn, _ = server.accept()
            started = None
            with conn:
                while chunk := conn.recv(1 << 20):
                    started = started or time.perf_counter()
                    got += len(chunk)
        print(got / (time.perf_counter() - started), flush=True)


def send(target: str) -> None:
    import socket

    host, port = target.rsplit(":", 1)
    block = bytes(1 << 20)
    with socket.create_connection((host, int(port))) as conn:
        for _ in range(RAW_BYTES >> 20):
            conn.sendall(block)


def report(rows: list[dict], size: int, rate: float, raw: float, args: argparse.Namespace) -> None:
    first, second, folder = rows
    agree = first["tokens"] == second["tokens"] == folder["tokens"]
    sent = first["sent_mb"] * 1e6
    where = ("loopback (no emulated link)" if args.loopback else f"PP = 2 CPU workers on host 1, orchestrator on "
             f"host 0; link {args.rate_mbit:g} Mbit/s each way, {2 * args.delay_ms:g} ms one way host to host")
    print(f"# shard transfer: {size / 1e6:.0f} MB checkpoint (bf16, 4 files); {where}; CURVE; raw TCP through it "
          f"{raw * 8 / 1e6:.0f} Mbit/s; outputs agree: {agree}")
    print("| start | sent | transfer | bytes ÷ link rate | bytes ÷ raw TCP | load | ready |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, row in (("1st: transfer, then cache", first), ("2nd: from the cache", second),
                      ("local folder", folder)):
        moved = row["sent_mb"] * 1e6
        ideal = f"{moved / rate:.2f} s" if moved else "—"
        raw_ideal = f"{moved / raw:.2f} s" if moved else "—"
        transfer = f"{row['transfer_s']:.2f} s ({moved / row['transfer_s'] * 8 / 1e6:.0f} Mbit/s)" if moved else "—"
        print(f"| {name} | {moved / 1e6:.0f} MB | {transfer} | {ideal} | {raw_ideal} | {row['load_s']:.2f} s | "
              f"{row['ready_s']:.2f} s |")
    if sent:
        print(f"transfer ÷ (bytes ÷ link rate) = {first['transfer_s'] / (sent / rate):.2f}")


if __name__ == "__main__":
    main()
