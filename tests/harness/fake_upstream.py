"""A fake engine behind the proxy, as a real process: it records what reached it and streams back.

    python3 tests/harness/fake_upstream.py --port P [--chunk-delay S] [--unready] [--health-status N] [--rcvbuf BYTES]

POST any path: the raw body and headers are kept for GET /debug/last. A JSON body with "stream": true gets
SSE events (a text delta, a tool-call delta, then [DONE]; "chunks": N for N of them) --chunk-delay apart, or with
"endless": true events
until the client leaves. POST /fail answers 500 with a JSON error, POST /busy 503 with Retry-After: 7, POST /drop
closes the connection unanswered, POST /slow?s=N answers after N seconds or ends when its connection closes
(counted open meanwhile), POST /deaf never reads
its body nor answers. A request
with an X-Reply-Hop header gets a reply whose Connection header names a hop-by-hop header of its own (X-Up-Hop).
GET /v1/models lists one model; GET /metrics has vLLM's prefix-cache counters; GET /debug/open counts streams open
now. GET /health answers 200 (--health-status N: N, as 404 from a server with no /health of its own); with --unready it and every request answer 503, as a vLLM starting or draining does,
until POST /debug/ready (the test, not the clock, says when it is ready: a busy box cannot reorder it).
"""

import argparse
import asyncio
import base64
import json
import signal
import socket
import time

from aiohttp import web

state = {"last": None, "open": 0, "requests": 0}
STOPPING = asyncio.Event()  # SIGTERM: /deaf lets go
EVENTS = [
    {"choices": [{"index": 0, "delta": {"content": "Hel"}}]},
    {"choices": [{"index": 0, "delta": {"content": "lo"}}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                        "function": {"name": "Read", "arguments": "{\"pa"}}]}}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "th\": \"/x\"}"}}]}}]},
]


def make_app(args) -> web.Application:
    state["ready"] = not args.unready

    @web.middleware
    async def unready(request, handler):
        if not state["ready"] and not request.path.startswith("/debug/"):
            state["unready"] = state.get("unready", 0) + 1
            state.setdefault("unready_paths", []).append(request.path)  # in order: a test waits on the proxy's look
            del state["unready_paths"][:-50]
            return web.json_response({"error": {"message": "the engine is not ready"}}, status=503)
        return await handler(request)

    async def health(request):
        return web.Response(text="", status=args.health_status)

    async def record(request):
        if request.path == "/deaf":  # takes a request and never reads its body, nor answers, until it stops
            state["requests"] += 1
            await STOPPING.wait()
            return web.Response(status=503)
        body = await request.read()
        state["requests"] += 1
        state["last"] = {"path": request.path_qs, "method": request.method, "body": base64.b64encode(body).decode(),
                         "headers": [[k, v] for k, v in request.headers.items()]}
        if request.path == "/fail":
            return web.json_response({"error": {"message": "engine is asleep"}}, status=500)
        if request.path == "/drop":  # the connection closed before any answer, its /health up
            request.transport.close()
            return web.Response()
        if request.path == "/busy":  # a 503 of its own, its /health up
            return web.json_response({"error": {"message": "busy"}}, status=503, headers={"Retry-After": "7"})
        if request.path == "/slow":  # a long answer not streamed (a big max_tokens): ?s=N seconds, open meanwhile,
            state["open"] += 1  # or until the connection closes, as vLLM aborts a request whose client left
            try:
                until = time.monotonic() + float(request.query.get("s", "60"))
                while time.monotonic() < until:
                    if request.transport is None or request.transport.is_closing():
                        return web.Response(status=499)  # nobody reads it
                    await asyncio.sleep(0.05)
            finally:
                state["open"] -= 1
            return web.json_response({"id": "x", "slow": True})
        try:
            parsed = json.loads(body) if body else {}
        except ValueError:
            parsed = {}
        if not isinstance(parsed, dict) or not parsed.get("stream"):
            headers = {"X-Engine": "fake"}
            if "X-Reply-Hop" in request.headers:
                headers.update({"Connection": "X-Up-Hop", "X-Up-Hop": "for the next hop only"})
            return web.json_response({"id": "x", "echo_bytes": len(body)}, headers=headers)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        state["open"] += 1
        try:
            n = 0
            while parsed.get("endless") or n < parsed.get("chunks", len(EVENTS)):
                event = EVENTS[n % len(EVENTS)]
                await response.write(f"data: {json.dumps(event)}\n\n".encode())
                n += 1
                await asyncio.sleep(args.chunk_delay)
            await response.write(b"data: [DONE]\n\n")
        finally:
            state["open"] -= 1
        return response

    async def last(request):
        return web.json_response(state["last"])

    async def open_streams(request):
        return web.json_response({"open": state["open"], "requests": state["requests"],
                                  "unready": state.get("unready", 0),
                                  "unready_paths": state.get("unready_paths", [])})

    async def ready(request):
        state["ready"] = True
        return web.json_response({"ready": True})

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def metrics(request):
        return web.Response(text="# TYPE vllm:prefix_cache_queries_total counter\nvllm:prefix_cache_queries_total 100\n"
                                 "# TYPE vllm:prefix_cache_hits_total counter\nvllm:prefix_cache_hits_total 40\n")

    app = web.Application(client_max_size=1 << 30, middlewares=[unready])
    app.router.add_get("/health", health)
    app.router.add_get("/debug/last", last)
    app.router.add_get("/debug/open", open_streams)
    app.router.add_post("/debug/ready", ready)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_route("*", "/{tail:.*}", record)
    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--chunk-delay", type=float, default=0.05)
    parser.add_argument("--unready", action="store_true")
    parser.add_argument("--health-status", type=int, default=200, help="GET /health's status")
    parser.add_argument("--rcvbuf", type=int, default=0, help="SO_RCVBUF of its connections (0: the kernel's)")
    args = parser.parse_args()

    async def serve():
        # auto_decompress off: a compressed body is recorded as it arrived, so a test sees what the proxy sent
        runner = web.AppRunner(make_app(args), access_log=None, auto_decompress=False)
        await runner.setup()
        if args.rcvbuf:  # a small receive window that does not grow: what it does not read stays with the sender
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, args.rcvbuf)
            sock.bind(("127.0.0.1", args.port))
            await web.SockSite(runner, sock).start()
        else:
            await web.TCPSite(runner, "127.0.0.1", args.port).start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, STOPPING.set)
        await STOPPING.wait()
        await runner.cleanup()

    asyncio.run(serve())
