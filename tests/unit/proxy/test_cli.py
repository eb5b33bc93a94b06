"""``python -m disagg proxy`` as a process: answers /health, drains and exits 0 on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from proxy_standin import read_events

from harness.ports import free_port

ROOT = Path(__file__).resolve().parents[3]


async def start_proxy(*args: str) -> tuple[asyncio.subprocess.Process, str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "disagg", "proxy", "--host", "127.0.0.1", "--port", str(port), *args,
        "--health-interval", "0.2", "--drain-timeout", "5", env=env, cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


async def wait_healthy(http, url: str, proc: asyncio.subprocess.Process, timeout: float = 15.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        assert proc.returncode is None, "the proxy exited early"
        try:
            async with http.get(url + "/health") as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError(f"{url}/health not 200 within {timeout}s")


async def test_cli_serves_health_and_exits_cleanly_on_sigterm(standin, http) -> None:
    p = await standin("P")
    d = await standin("D")
    proc, url = await start_proxy("--prefill", p.url, "--decode", d.url)
    try:
        await wait_healthy(http, url, proc)
        async with http.post(url + "/v1/completions", json={"prompt": "x"}) as resp:
            assert resp.status == 200
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
        assert proc.stdout is not None
        log = (await proc.stdout.read()).decode()
        assert "listening on" in log and "draining" in log
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_sigterm_lets_an_in_flight_stream_finish(standin, http) -> None:
    gate = asyncio.Event()
    d = await standin("D", tokens=3, gate=gate)
    proc, url = await start_proxy("--decode", d.url)
    try:
        await wait_healthy(http, url, proc)
        resp = await http.post(url + "/v1/completions", json={"prompt": "x", "stream": True})
        first = await resp.content.readline()
        assert first.startswith(b"data: ")
        proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        assert proc.returncode is None, "the proxy waits for the in-flight stream"
        gate.set()
        rest = await read_events(resp)
        assert rest[-1] == "[DONE]" and len(rest) == 3
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_cli_bad_url_is_a_one_line_error() -> None:
    proc, _ = await start_proxy("--decode", "not-a-url")
    out, _ = await proc.communicate()
    assert proc.returncode == 2
    assert out.decode().strip() == "disagg: error: decode URL 'not-a-url' is not an http(s)://host:port URL"
