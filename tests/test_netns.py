"""Two emulated hosts (tools/hosts.py: network namespaces joined by VDE wirefilter links with a real
one-way delay): PP = 2 across them, worker to worker over CURVE (the orchestrator's connections and
the stage links) and relayed through the orchestrator, gives transformers' greedy output with MTP
on.

Host 0 runs the orchestrator and worker 0 (rank 0, hence the rendezvous), host 1 runs worker 1;
every orchestrator <-> worker 1 message, every collective and every stage link crosses the delayed
link. Needs root and Debian's vde2 + vde-wirefilter (installed by .ci/run); elsewhere the tests
are skipped and say what is missing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hosts import EmulatedHosts
from reference import hf_greedy, hf_model

from shardspec import security

PROMPT = [5, 17, 300, 42, 7, 99]
DELAY_MS = 2.0  # one way, host to host
PORT = 7000

pytestmark = pytest.mark.skipif(EmulatedHosts.missing() is not None, reason=str(EmulatedHosts.missing()))


@pytest.fixture(scope="module")
def curve_keys(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("netns-keys")
    security.generate(root / "worker", "worker")
    security.generate(root / "orchestrator", "orchestrator")
    return root


def run_across_hosts(model: Path, tmp_path: Path, options: list[str], worker_options: list[str],
                     orchestrator_options: list[str]) -> tuple[list[int], str]:
    """Greedy tokens of PROMPT from `shardspec generate` on host 0, with worker i on host i; and the logs."""
    with EmulatedHosts(2, DELAY_MS / 2) as hosts:  # each host's link to the switch carries half the delay
        addresses = [f"tcp://{hosts.address(i)}:{PORT}" for i in range(2)]
        for i, address in enumerate(addresses):
            with open(tmp_path / f"worker{i}.log", "wb") as log:
                hosts.popen(i, [sys.executable, "-m", "shardspec", "worker", "--listen", address, "--threads", "1",
                                *worker_options], stdout=log, stderr=subprocess.STDOUT)
        for i in range(2):
            hosts.wait_listening(i, PORT)
        with open(tmp_path / "orchestrator.log", "wb") as log:
            orchestrator = hosts.popen(
                0, [sys.executable, "-m", "shardspec", "generate", "--model", str(model), "--workers",
                    ",".join(addresses), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", "24",
                    "--temperature", "0", "--json", *options, *orchestrator_options],
                stdout=subprocess.PIPE, stderr=log)
            out, _ = orchestrator.communicate(timeout=300)
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(tmp_path.glob("*.log")))
    assert orchestrator.returncode == 0, logs
    return json.loads(out)["token_ids"], logs


def curve_options(keys: Path) -> tuple[list[str], list[str]]:
    return (["--keys", str(keys / "worker"), "--allow", str(keys / "orchestrator" / "orchestrator.key")],
            ["--keys", str(keys / "orchestrator"), "--server-keys", str(keys / "worker" / "worker.key")])


@pytest.mark.parametrize("relay", [False, True], ids=["direct-curve", "relayed"])
def test_pp2_across_two_emulated_hosts_equals_transformers_with_mtp(tiny_model, tmp_path, curve_keys, relay):
    workers, orchestrator = curve_options(curve_keys) if not relay else (["--insecure"], [])
    options = ["--pp", "2", *(["--relay"] if relay else ["--no-relay"])]
    remote, logs = run_across_hosts(tiny_model, tmp_path, options, workers, orchestrator)
    assert remote == hf_greedy(hf_model(tiny_model), PROMPT, 24)
    assert ("relayed through the orchestrator" in logs) == relay
    assert ("stage link at" in logs and "(CURVE)" in logs) == (not relay)
