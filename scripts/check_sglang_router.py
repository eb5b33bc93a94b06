"""Real sglang-router (PyPI) in PD mode in front of the stand-in SGLang servers
of tests/unit/proxy/sglang_standin.py: cross-checks that the stand-ins speak
the bootstrap protocol the way SGLang's own router does.

    PYTHONPATH=$PWD VENV/bin/python scripts/check_sglang_router.py   # VENV has sglang-router, aiohttp

Exit 0 when the router started, forwarded a streamed completion, and prefill
and decode received the same bootstrap room.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests/unit/proxy"))
from sglang_standin import SglangStandIn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def check(log: Path) -> int:
    p, d = SglangStandIn("prefill"), SglangStandIn("decode")
    await p.start()
    await d.start()
    port = free_port()
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--pd-disaggregation", "--prefill", p.url, str(p.bootstrap_port), "--decode", d.url]
    print("router:", " ".join(argv[1:]))
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            for _ in range(100):
                try:
                    async with s.get(f"http://127.0.0.1:{port}/health") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.3)
            body = {"model": "m", "prompt": "hello", "max_tokens": 3, "stream": True}
            async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                text = (await r.read()).decode()
                print("status", r.status, "events", text.count("data:"))
        same = bool(p.received and d.received
                    and p.received[0]["bootstrap_room"] == d.received[0]["bootstrap_room"])
        print("prefill got:", json.dumps(p.received[:1]))
        print("same bootstrap room on both sides:", same)
        return 0 if same and "tok2" in text else 1
    finally:
        proc.terminate()
        proc.wait(10)
        await p.stop()
        await d.stop()


if __name__ == "__main__":
    sys.exit(asyncio.run(check(Path("/tmp/sglang-router-check.log"))))
