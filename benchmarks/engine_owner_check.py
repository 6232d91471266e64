"""What the proxy's check of the engine's socket costs (base/sockowner.py, proxy/upstream.py): per new connection.

    python3 benchmarks/engine_owner_check.py [--checks 2000] [--crowd 5000]

On one loopback connection of this process: the owner of its far end read by sock_diag (what every new connection
of the proxy to the engine costs; a kept-alive one is never checked again), and by /proc/net/tcp (the fallback:
no netlink, or an end in SYN_RECV); then both again with --crowd more connections open on the host, as a local user
can open to make the tables long. Last, a fresh connection and a GET through aiohttp, with and without the check.
"""

import argparse
import asyncio
import os
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "daemon"))
from gpuwarden.base import sockowner  # noqa: E402


def lines() -> int:
    return sum(sum(1 for _ in open(f"/proc/net/{t}", "rb")) - 1 for t in ("tcp", "tcp6"))


def micros(call, n: int) -> tuple[float, float]:
    """(median, p99) of n calls, in µs."""
    times = []
    for _ in range(n):
        began = time.perf_counter()
        call()
        times.append((time.perf_counter() - began) * 1e6)
    times.sort()
    return statistics.median(times), times[int(len(times) * 0.99) - 1]


def measure(label: str, conn: socket.socket, n: int) -> None:
    near, far = conn.getsockname(), conn.getpeername()
    ends = sockowner._endpoint(near), sockowner._endpoint(far)
    assert sockowner.owner(near, far) == os.geteuid() and sockowner.table_owner(*ends)[1] == os.geteuid()
    diag = micros(lambda: sockowner.owner(near, far), n)
    table = micros(lambda: sockowner.table_owner(*ends), max(10, n // 100))
    print(f"{label}: {lines()} lines in /proc/net/tcp and tcp6; sock_diag {diag[0]:.1f} µs median, {diag[1]:.1f} "
          f"p99; /proc/net/tcp {table[0] / 1000:.2f} ms median, {table[1] / 1000:.2f} p99")


async def through_aiohttp(port: int, n: int) -> None:
    import aiohttp

    from gpuwarden.proxy.upstream import EngineConnector

    for uid, label in ((None, "unchecked"), (os.geteuid(), "checked")):
        times = []
        async with aiohttp.ClientSession(connector=EngineConnector(uid=uid, force_close=True)) as session:
            for _ in range(n):
                began = time.perf_counter()
                async with session.get(f"http://127.0.0.1:{port}/health") as reply:
                    await reply.read()
                times.append((time.perf_counter() - began) * 1e6)
        times.sort()
        print(f"a fresh connection and GET /health through aiohttp, {label}: {statistics.median(times):.0f} µs "
              f"median, {times[int(n * 0.99) - 1]:.0f} p99")


async def serve_health(server: socket.socket) -> None:
    from aiohttp import web

    async def health(request):
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.SockSite(runner, server).start()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checks", type=int, default=2000)
    parser.add_argument("--crowd", type=int, default=5000, help="loopback connections opened for the second run")
    args = parser.parse_args()
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4096)
    port = server.getsockname()[1]
    conn = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    measure("as the host is", conn, args.checks)
    crowd = []
    for _ in range(args.crowd):
        crowd.append(socket.create_connection(("127.0.0.1", port)))
        crowd.append(server.accept()[0])
    measure(f"with {args.crowd} more connections", conn, args.checks)
    for s in crowd:
        s.close()

    async def run():
        await serve_health(server)
        await through_aiohttp(port, max(100, args.checks // 4))

    asyncio.run(run())


if __name__ == "__main__":
    main()
