"""The operator's view: a load's progress from every worker, `shardspec status`, the server's
`/health` while loading, `/status.json` and the status page (in headless Chromium where it is)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import WorkerProcess, wait_for_socket
from test_server import start_server

import shardspec
from shardspec import security
from shardspec.cli.load_display import LoadDisplay
from shardspec.orchestrator.requests import EngineError
from shardspec.orchestrator.workers import WorkerLost
from shardspec.protocol.messages import LoadProgress
from shardspec.server.run import LoadingGate

# --- load progress ---------------------------------------------------------------------------------


def test_each_workers_load_progress_rises_to_its_total_and_the_display_draws_it(tiny_model, spawn_worker):
    workers = [spawn_worker().address, spawn_worker().address]
    seen: list[list[LoadProgress | None]] = []

    async def run():
        async with shardspec.connect(model=str(tiny_model), workers=workers, pp=2, on_progress=seen.append):
            pass

    asyncio.run(run())
    for rank in range(2):
        reports = [progress[rank] for progress in seen if progress[rank] is not None]
        assert len(reports) >= 2, reports
        done = [r.bytes_done for r in reports]
        assert done == sorted(done) and reports[0].bytes_done < reports[0].bytes_total
        assert reports[-1].bytes_done == reports[-1].bytes_total > 0
        assert reports[-1].tensors_done == reports[-1].tensors_total
    out = _Terminal()
    display = LoadDisplay([Path(w).name for w in workers], out, terminal=True)
    for progress in seen:
        display(progress)
    display.close()
    assert all(Path(w).name in out.getvalue() for w in workers) and "100%" in out.getvalue()
    logged = _Terminal()
    line = LoadDisplay(workers, logged, terminal=False).line(seen[-1])
    assert line.startswith("loading: 100% of") and "by 2 of 2 workers" in line


def test_a_worker_lost_mid_load_fails_the_load_naming_it(tiny_model, spawn_worker):
    w0, w1 = spawn_worker(), spawn_worker()

    def progressed(progress: list[LoadProgress | None]) -> None:
        if progress[1] is not None and progress[1].bytes_done < progress[1].bytes_total:
            w1.proc.kill()  # after its first tensor, before its last

    async def run():
        async with shardspec.connect(model=str(tiny_model), workers=[w0.address, w1.address], pp=2,
                                     on_progress=progressed):
            pass

    started = time.monotonic()
    with pytest.raises((EngineError, WorkerLost)) as info:
        asyncio.run(run())
    assert w1.address in str(info.value), info.value
    assert time.monotonic() - started < 30


def test_an_on_progress_that_raises_fails_the_load_with_its_exception_and_the_workers_go_idle(tiny_model,
                                                                                               spawn_worker):
    workers = [spawn_worker().address, spawn_worker().address]

    def broken(progress: list[LoadProgress | None]) -> None:
        raise ZeroDivisionError("the caller's bug")

    async def run():
        async with shardspec.connect(model=str(tiny_model), workers=workers, pp=2, on_progress=broken):
            pass

    started = time.monotonic()
    with pytest.raises(ZeroDivisionError, match="the caller's bug"):
        asyncio.run(run())
    assert time.monotonic() - started < 30

    async def again():  # (the workers left the group: the next engine takes them)
        async with shardspec.connect(model=str(tiny_model), workers=workers, pp=2) as engine:
            return [c.token_ids async for c in engine.generate([1, 2, 3], max_tokens=2)]

    assert sum(len(ids) for ids in asyncio.run(again())) == 2


def test_health_says_loading_with_the_share_read_and_other_routes_503_until_the_app_is_in():
    gate = LoadingGate()
    gate.on_progress([LoadProgress(3, 10, 300, 1000), None])

    async def run():
        transport = httpx.ASGITransport(app=gate)
        async with httpx.AsyncClient(transport=transport, base_url="http://gate") as http:
            health, other = await http.get("/health"), await http.post("/v1/completions", json={})
            return health, other

    health, other = asyncio.run(run())
    assert health.status_code == 503 and health.json() == {"status": "loading", "progress": 0.15}
    assert other.status_code == 503 and "loading" in other.json()["error"]["message"]


class _Terminal:
    """A text stream that says it is a terminal (tqdm draws bars on it)."""

    def __init__(self):
        self.parts: list[str] = []

    def write(self, text: str) -> int:
        self.parts.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return True

    def getvalue(self) -> str:
        return "".join(self.parts)


# --- shardspec status ------------------------------------------------------------------------------


def status(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardspec", "status", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_status_tells_an_idle_worker_and_an_owned_one_without_taking_it_over(tiny_model, spawn_worker):
    worker = spawn_worker()
    idle = status(worker.address)
    assert idle.returncode == 0 and f"{worker.address}: idle;" in idle.stdout, idle

    async def run():
        async with shardspec.connect(model=str(tiny_model), workers=[worker.address]) as engine:
            owned = await asyncio.to_thread(status, "--json", worker.address)
            tokens = [t async for chunk in engine.generate([1, 2, 3], max_tokens=4) for t in chunk.token_ids]
            return owned, tokens

    owned, tokens = asyncio.run(run())
    assert len(tokens) == 4  # the engine kept its worker
    report = json.loads(owned.stdout)
    assert report["state"] == "loaded" and report["owner"] == f"local pid {os.getpid()}"
    assert report["model"] == tiny_model.name
    assert report["layers"] == [0, 4] and report["stages"] == 1 and report["loading"] is None
    assert "/" not in json.dumps({k: v for k, v in report.items() if k != "address"})  # no path


def test_status_of_a_keyed_worker_without_keys_is_refused_clearly_and_with_them_answered(tmp_path):
    security.generate(tmp_path / "w", "worker")
    security.generate(tmp_path / "o", "orchestrator")
    worker = WorkerProcess(tmp_path / "keyed.sock", "--keys", str(tmp_path / "w"), "--allow",
                           str(tmp_path / "o" / "orchestrator.key"))
    try:
        wait_for_socket(worker.address, process=worker.proc)
        refused = status(worker.address, "--timeout", "5")
        keyed = status(worker.address, "--keys", str(tmp_path / "o"), "--server-keys",
                       str(tmp_path / "w" / "worker.key"))
    finally:
        worker.stop()
    assert refused.returncode == 1 and "asks for CURVE keys" in refused.stdout and "--keys" in refused.stdout, refused
    assert keyed.returncode == 0 and "idle" in keyed.stdout, keyed
    secret = (tmp_path / "o" / "orchestrator.key_secret").read_text()
    key = re.search(r'secret-key = "(.+)"', secret).group(1)
    assert key not in refused.stdout + keyed.stdout + refused.stderr + keyed.stderr


@pytest.mark.slow  # (15-25 s of workers and timeouts)
def test_status_where_nothing_listens_is_a_clear_error_within_the_connect_grace(tmp_path):
    from shardspec.orchestrator.workers import free_port

    started = time.monotonic()
    result = status(f"tcp://127.0.0.1:{free_port()}", f"ipc://{tmp_path}/none.sock", "--timeout", "30")
    assert result.returncode == 1
    assert result.stdout.count("connection refused: is a worker listening") == 2, result.stdout
    assert time.monotonic() - started < 25 and "Traceback" not in result.stderr


def test_status_of_something_that_is_no_address_is_a_usage_error():
    bogus = status("bogus")
    assert bogus.returncode == 2 and "tcp://HOST:PORT or ipc://PATH" in bogus.stderr, bogus.stderr


# --- the status page ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pp_server(tmp_path_factory):
    """The bundled model on two local workers as two pipeline stages."""
    started = start_server(tmp_path_factory.mktemp("status-server"), "--local", "2", "--pp", "2")
    yield started
    assert started.stop() == 0, started.log.read_text(errors="replace")


def test_status_json_lays_out_hosts_stages_and_ranks_and_counts_steps_and_acceptance(pp_server):
    before = httpx.get(f"{pp_server.root}/status.json").json()
    reply = httpx.post(f"{pp_server.url}/completions", json={"prompt": "def f(x):", "max_tokens": 24},
                       timeout=120)
    assert reply.status_code == 200
    after = httpx.get(f"{pp_server.root}/status.json").json()
    assert after["healthy"] and after["stages"] == 2 and after["world_size"] == 2
    (host,) = after["hosts"]
    layers = [rank["layers"] for stage in host["stages"] for rank in stage["ranks"]]
    assert [stage["stage"] for stage in host["stages"]] == [0, 1] and layers[0][1] == layers[1][0]
    assert all(rank["state"] == "loaded" for stage in host["stages"] for rank in stage["ranks"])
    assert after["steps"] > before["steps"] and after["step_ms_p50"] > 0
    assert len(after["acceptance_per_position"]) == after["draft_tokens"] and after["mean_acceptance_length"] >= 1
    text = json.dumps(after)
    assert "/tmp" not in text and "Traceback" not in text and "key" not in text.lower()


def test_the_status_page_in_a_browser_shows_the_stages_and_follows_a_request(pp_server):
    """Headless Chromium at a phone's width: both stages and their layers, then a request moves the
    step count and the acceptance figures."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    browser, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if browser is None or driver_path is None:
        pytest.skip("headless Chromium needs Debian's chromium and chromium-driver (.ci/run installs them)")
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    options.add_experimental_option("mobileEmulation", {"deviceMetrics": {"width": 390, "height": 844,
                                                                          "pixelRatio": 3}})  # a phone
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        driver.get(f"{pp_server.root}/status")
        wait = WebDriverWait(driver, 30)
        wait.until(lambda d: "stage 1" in d.find_element(By.ID, "hosts").text)
        hosts = driver.find_element(By.ID, "hosts").text
        assert "stage 0" in hosts and "stage 1" in hosts and "loaded" in hosts
        assert "0–3" in hosts and "4–7" in hosts  # the bundled model's 8 layers, 4 a stage
        summary = driver.find_element(By.ID, "summary").text
        steps = int(re.search(r"Steps\s+(\d+)", summary).group(1))
        acceptance = driver.find_element(By.ID, "mtp").text
        reply = httpx.post(f"{pp_server.url}/completions", json={"prompt": "class A:", "max_tokens": 16},
                           timeout=120)
        assert reply.status_code == 200
        wait.until(lambda d: int(re.search(r"Steps\s+(\d+)", d.find_element(By.ID, "summary").text).group(1))
                   > steps)
        wait.until(lambda d: d.find_element(By.ID, "mtp").text != acceptance)
        assert "mean acceptance length" in driver.find_element(By.ID, "mtp").text
        width, window = driver.execute_script("return [document.documentElement.scrollWidth, window.innerWidth]")
        assert window == 390 and width <= window, (width, window)  # nothing wider (tables scroll inside)
    finally:
        driver.quit()
