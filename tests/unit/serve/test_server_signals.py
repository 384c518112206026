"""`rlpost serve`'s HTTP server stops on SIGINT (Ctrl-C) and SIGTERM and says which came, without
raising the signal again (uvicorn's own would end the process before the fleet is stopped)."""

import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

SERVER = """
import asyncio, uvicorn
from starlette.applications import Starlette
from rlpost.serve.server import _uvicorn_server

server = _uvicorn_server(uvicorn.Config(Starlette(), host="127.0.0.1", port=0, log_level="warning", lifespan="off"))

async def main():
    task = asyncio.get_running_loop().create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    print("started", flush=True)
    await task

asyncio.run(main())
print("stopped by", server.stopped_by, flush=True)
"""


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_the_server_and_is_remembered(stop):
    child = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "started"
        child.send_signal(stop)
        out, err = child.communicate(timeout=30)
    finally:
        child.kill()
    assert child.returncode == 0, err
    assert out.strip() == f"stopped by {int(stop)}"
