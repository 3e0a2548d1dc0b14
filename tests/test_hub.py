"""Models named by a Hub id, against a local fake Hub (shardspec.testing.fake_hub, HF_ENDPOINT; each
process its own HF_HOME): the orchestrator fetches config and tokenizer only, each worker only the
safetensors files of its stage; a warm Hub cache serves offline. Nothing here touches the network."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardspec.models.checkpoint import Checkpoint
from shardspec.models.hub import HubRef, parse_ref
from shardspec.models.loader import stage_keys
from shardspec.models.shard_files import hub_key
from shardspec.orchestrator.config import EngineConfig
from shardspec.orchestrator.engine import connect
from shardspec.protocol.messages import LoadProgress
from shardspec.shard_worker.shard_cache import ShardCache
from shardspec.shard_worker.sources import hub_files, open_source, stage_of
from shardspec.testing.fake_hub import FakeHub
from shardspec.testing.random_checkpoint import tiny_config, write_random_checkpoint

PROMPT = "3,1,4,1,5,9,2,6"


@pytest.fixture(scope="module")
def sharded_model(tmp_path_factory) -> Path:
    """A tiny random model in six safetensors files, with an index."""
    path = tmp_path_factory.mktemp("sharded-model")
    write_random_checkpoint(path, tiny_config(), seed=3, layout="model", shards=6)
    return path


def hub_env(hub: FakeHub, home: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(home), "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            **extra}


def generate(model: str, env: dict[str, str], *options: str) -> list[int]:
    """`shardspec generate` in a process of its own (its own Hub settings), greedy; its token ids."""
    done = subprocess.run([sys.executable, "-m", "shardspec", "generate", "--model", model, "--prompt-ids", PROMPT,
                           "--max-tokens", "10", "--temperature", "0", "--dtype", "float32", "--json", *options],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["token_ids"]


def cached_weights(home: Path) -> set[str]:
    """The safetensors files in a Hub cache (HF_HOME)."""
    return {path.name for path in (home / "hub").rglob("*.safetensors")}


def test_a_hub_id_is_org_name_at_revision_and_a_path_that_exists_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse_ref("Qwen/Qwen3.5-9B") == HubRef("Qwen/Qwen3.5-9B")
    assert parse_ref("Qwen/Qwen3.5-9B@v1.0") == HubRef("Qwen/Qwen3.5-9B", "v1.0")
    assert parse_ref("Qwen/Qwen3.5-9B@" + "a" * 40).pinned
    for path in ("/models/qwen", "./Qwen/Qwen3.5-9B", "models/a/b", "../x/y", "plain"):
        assert parse_ref(path) is None, path
    (tmp_path / "Qwen" / "Qwen3.5-9B").mkdir(parents=True)
    assert parse_ref("Qwen/Qwen3.5-9B") is None  # a folder here: the folder


@pytest.fixture
def in_process_hub(tmp_path, sharded_model, monkeypatch):
    """The fake Hub for huggingface_hub in this process (it reads HF_ENDPOINT and HF_HOME once, at import)."""
    from huggingface_hub import constants

    with FakeHub({"org/tiny": sharded_model}) as hub:
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            hub.url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        yield hub


def test_the_orchestrator_fetches_config_and_tokenizer_only_and_pins_the_commit(in_process_hub, sharded_model):
    config = EngineConfig(model="org/tiny", workers=["ipc:///tmp/a.sock", "ipc:///tmp/b.sock"], pp=2)
    config.check_model_folder()
    commit = in_process_hub.repos["org/tiny"].commit
    assert config.load_request().model == f"org/tiny@{commit}" and config.hub_model.commit == commit
    assert {name for *_, name in in_process_hub.requests} == {"config.json", "model.safetensors.index.json"}
    assert config.model_key == hub_key(f"org/tiny@{commit}")


@pytest.mark.parametrize("stage", [0, 1])
def test_a_worker_fetches_only_the_safetensors_files_of_its_stage_and_reports_them(in_process_hub, sharded_model,
                                                                                   tmp_path, stage):
    commit = in_process_hub.repos["org/tiny"].commit
    cache = ShardCache(tmp_path / "shards")
    source = open_source(f"org/tiny@{commit}", "", cache, None, stage, 2, "auto", [])
    layers, mtp = stage_of(source.checkpoint, "auto", [], stage, 2)
    reports: list[LoadProgress] = []
    source.fetch(layers, mtp, reports.append)
    checkpoint = Checkpoint.open(sharded_model)
    wanted = {checkpoint.files[name].name for name in stage_keys(checkpoint, layers, mtp)}
    assert set(in_process_hub.fetched()) - {"config.json", "model.safetensors.index.json"} == wanted
    assert wanted < {path.name for path in checkpoint.files.values()}
    assert reports[-1].tensors_done == reports[-1].tensors_total == len(wanted)
    assert reports[-1].bytes_done == sum((sharded_model / name).stat().st_size for name in wanted)


@pytest.mark.slow  # an orchestrator process and two workers: ~10 s on an idle 2-core host, 20 s on a busy one
def test_a_hub_id_serves_as_its_folder_and_each_pp_stage_fetches_only_its_files(tmp_path, sharded_model,
                                                                              spawn_worker, monkeypatch):
    checkpoint = Checkpoint.open(sharded_model)
    expected = [set(hub_files(checkpoint, *stage_of(checkpoint, "auto", [], stage, 2))) for stage in range(2)]
    with FakeHub({"org/tiny": sharded_model}) as hub:
        workers = []
        for rank in range(2):  # (a worker's environment is the test's at its start)
            monkeypatch.setenv("HF_ENDPOINT", hub.url)
            monkeypatch.setenv("HF_HOME", str(tmp_path / f"hf{rank}"))
            workers.append(spawn_worker("--model-dir", str(tmp_path / "no-folders")).address)
        monkeypatch.delenv("HF_HOME")
        tokens = generate("org/tiny", hub_env(hub, tmp_path / "hf-orchestrator"), "--workers", ",".join(workers),
                          "--pp", "2")
    assert cached_weights(tmp_path / "hf-orchestrator") == set()  # config and tokenizer only
    for rank in range(2):
        assert cached_weights(tmp_path / f"hf{rank}") == expected[rank]
        assert expected[rank] < {path.name for path in checkpoint.files.values()}
    assert tokens == asyncio.run(_folder_tokens(sharded_model))


async def _folder_tokens(folder: Path) -> list[int]:
    async with connect(model=str(folder), local=1, dtype="float32", max_seqs=1) as engine:
        ids = [int(i) for i in PROMPT.split(",")]
        return [t async for chunk in engine.generate(ids, max_tokens=10, temperature=0.0) for t in chunk.token_ids]


@pytest.mark.slow  # two orchestrators spawning their workers: ~15 s
def test_a_warm_hub_cache_serves_offline_with_the_hub_gone(tmp_path):
    bundled = Path(__file__).parents[1] / "src" / "shardspec" / "bundled"
    with FakeHub({"org/bundled": bundled}) as hub:
        env = hub_env(hub, tmp_path / "hf")
        online = generate("org/bundled", env, "--local", "1")
    offline = generate("org/bundled", {**env, "HF_HUB_OFFLINE": "1"}, "--local", "1")
    assert online == offline
    assert hub.fetched().count("model.safetensors") == 1


@pytest.fixture(scope="module")
def sharded_bundled(tmp_path_factory) -> Path:
    """The bundled model (its tokenizer too) re-saved in four safetensors files with an index."""
    from safetensors.torch import load_file, save_file

    bundled = Path(__file__).parents[1] / "src" / "shardspec" / "bundled"
    path = tmp_path_factory.mktemp("bundled-sharded")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((bundled / name).read_bytes())
    tensors = load_file(bundled / "model.safetensors")
    names = sorted(tensors, key=lambda n: (not n.startswith("model.embed"), n.startswith(("mtp.", "lm_head")), n))
    weight_map = {}
    for shard in range(4):
        part = names[shard * len(names) // 4 : (shard + 1) * len(names) // 4]
        file = f"model-0000{shard + 1}-of-00004.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, path / file)
        weight_map.update(dict.fromkeys(part, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


@pytest.mark.slow  # a server and two workers: ~15 s
def test_serve_with_a_hub_id_answers_and_each_worker_log_names_only_its_files(tmp_path, sharded_bundled,
                                                                               spawn_worker, monkeypatch):
    import httpx

    with FakeHub({"org/bundled": sharded_bundled}) as hub:
        workers = []
        for rank in range(2):
            monkeypatch.setenv("HF_ENDPOINT", hub.url)
            monkeypatch.setenv("HF_HOME", str(tmp_path / f"hf{rank}"))
            workers.append(spawn_worker("--model-dir", str(tmp_path / "no-folders")))
        monkeypatch.delenv("HF_HOME")
        server = subprocess.Popen([sys.executable, "-m", "shardspec", "serve", "--model", "org/bundled", "--port", "0",
                                   "--workers", ",".join(w.address for w in workers), "--pp", "2"],
                                  env=hub_env(hub, tmp_path / "hf-server"), stderr=subprocess.PIPE, text=True)
        try:
            line = ""
            while "serving" not in line:
                line = server.stderr.readline()
                assert line or server.poll() is None, "the server exited"
            url = line.split(" at ")[1].split()[0]
            reply = httpx.post(f"{url}/completions", json={"model": "bundled", "prompt": "def f(x):",
                                                           "max_tokens": 8, "temperature": 0}, timeout=60)
        finally:
            server.terminate()
            server.wait(30)
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"]
    assert f"org/bundled@{hub.repos['org/bundled'].commit}" in line
    checkpoint = Checkpoint.open(sharded_bundled)
    for rank, worker in enumerate(workers):
        files = hub_files(checkpoint, *stage_of(checkpoint, "auto", [], rank, 2))
        assert f"safetensors files of org/bundled@{hub.repos['org/bundled'].commit} from the Hub" in worker.log_text()
        assert f": {', '.join(files)}\n" in worker.log_text()
        assert cached_weights(tmp_path / f"hf{rank}") == set(files)
    assert cached_weights(tmp_path / "hf-server") == set()


@pytest.mark.slow  # two workers and two loads: ~15 s
def test_workers_without_hub_access_receive_their_stages_of_a_hub_model_from_the_orchestrator(
        in_process_hub, sharded_model, tmp_path, spawn_worker, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the workers': no Hub, an empty Hub cache
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-worker"))
    workers = [spawn_worker("--model-dir", str(tmp_path / "no-folders"), "--cache-dir", str(tmp_path / f"c{i}"))
               for i in range(2)]

    async def tokens() -> list[int]:
        async with connect(model="org/tiny", workers=[w.address for w in workers], pp=2, dtype="float32",
                           max_seqs=1) as engine:
            ids = [int(i) for i in PROMPT.split(",")]
            return [t async for c in engine.generate(ids, max_tokens=10, temperature=0.0) for t in c.token_ids]

    received = asyncio.run(tokens())
    assert all("receiving" in w.log_text() for w in workers)
    assert cached_weights(tmp_path / "hf-worker") == set()
    checkpoint = Checkpoint.open(sharded_model)
    needed = set().union(*(hub_files(checkpoint, *stage_of(checkpoint, "auto", [], s, 2)) for s in range(2)))
    assert {p.name for p in Path(constants.HF_HUB_CACHE).rglob("*.safetensors")} == needed
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert received == asyncio.run(_folder_tokens(sharded_model))
