"""A fake OpenAI-compatible streaming server with vLLM's counters, for `gpuwarden bench` tests.

    python3 tests/harness/fake_openai.py --port P [--model M] [--token-delay S] [--reject-ignore-eos] [--fail-all]
                                 [--tokenize] [--endless] [--error-bytes N] [--usage-event TEXT] [--models-body TEXT]
                                 [--good-first N] [--sim-state DIR [--prefill-ms MS] [--sim-gpu N]]

Prompt tokens are the prompt's words (+1); each output token is one SSE chunk after --token-delay seconds,
then a usage chunk and [DONE]. /metrics counts tokens as vLLM names them; /debug/open says how many streams
are open now (a client that leaves sockets behind shows there) and how many bytes of error bodies went out.

Misbehaving modes, for bench's limits: --endless streams tokens and never ends (for an hour, ignoring
max_tokens); --error-bytes N answers 500 with an N-byte body, written a MiB at a time as the client takes it; a
large --token-delay is a server that sends a token every so many seconds; --usage-event TEXT sends TEXT as the
data of the usage event, --models-body TEXT as the answer to /v1/models. --good-first N serves the first N
completion requests (bench's calibration) as a well-behaved server would, quickly and whole.

--sim-state DIR serves at the speed of the simulated cards (gpuwarden.gpu.sim.power): each token's delay is
--token-delay over the decode speed at the clock its GPU (--sim-gpu, 0 by default) keeps under load, and a prompt
first takes --prefill-ms per token over the prefill speed; the streams open are written back (none at start), so
the simulated card is busy while it serves (with --sim-gpu, that card alone: load.json's "gpus"; without it every
card) and idle otherwise, with the share of that time spent on prefill (the open requests' prefill seconds over
their prefill and decode seconds, as served here), so that the simulated card's GPM figures follow the workload.
"""

import argparse
import asyncio
import json
import time
from pathlib import Path

from aiohttp import web

state = {"generated": 0, "prompt": 0, "running": 0, "queries": 0, "hits": 0, "open": 0, "peak": 0, "completions": 0,
         "error_bytes_sent": 0}
ENDLESS_S = 3600.0  # "never" for any test, and still a bounded loop
GOOD_TOKEN_DELAY = 0.002


async def pause(request, seconds: float) -> None:
    """Sleep, or raise ConnectionResetError as soon as the client hangs up: newer aiohttp leaves the handler of a
    client that has gone running, and a token every 600 s would hold its stream (and our shutdown) that long."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while True:
        if request.transport is None or request.transport.is_closing():
            raise ConnectionResetError("the client hung up")
        if loop.time() >= end:
            return
        await asyncio.sleep(min(0.05, end - loop.time()))


class SimSpeed:
    """The simulated card's speeds, read from the channel at most every 50 ms; streams open written back."""

    def __init__(self, directory: Path | None, gpu: int | None = None):
        self.directory, self._at, self._speeds = directory, 0.0, (1.0, 1.0)
        self.gpu = gpu  # the card it serves on; None: GPU 0's speed, and every card busy (as before --sim-gpu)
        self.work: dict[object, tuple[float, float]] = {}  # each open request's (prefill, decode) seconds
        self.share: float | None = None
        # The server owns its cards' load from the moment it listens: idle until a request comes, not whatever the
        # scenario's timeline had them doing (a scenario's load under a tune's idle reading withheld every tok/J).
        self._write()

    def speeds(self) -> tuple[float, float]:
        """(decode, prefill) relative speed; 1.0 without a channel."""
        if self.directory is None:
            return 1.0, 1.0
        if time.monotonic() - self._at > 0.05:
            from gpuwarden.gpu.sim import power
            index = self.gpu or 0
            mine = [g for g in power.read_gpus(self.directory) if g.get("index") == index]
            if mine:
                f, knee = mine[0]["loaded_fraction"], mine[0]["decode_knee_fraction"]
                self._speeds = (max(0.01, power.speed("decode", f, knee)), max(0.01, power.speed("prefill", f, knee)))
            self._at = time.monotonic()
        return self._speeds

    def opened(self, key: object, prefill_s: float, decode_s: float) -> None:
        self.work[key] = (prefill_s, decode_s)
        self._write()

    def closed(self, key: object) -> None:
        self.work.pop(key, None)
        self._write()

    def _write(self) -> None:
        if self.directory is None:
            return
        from gpuwarden.gpu.sim import power
        prefill = sum(p for p, _ in self.work.values())
        total = prefill + sum(d for _, d in self.work.values())
        if total > 0:  # with nothing open the last share stays: the card's busy hold still runs that work
            self.share = prefill / total
        power.write_load(self.directory, state["open"], self.share, None if self.gpu is None else [self.gpu])


def make_app(args) -> web.Application:
    sim = SimSpeed(args.sim_state, args.sim_gpu)

    async def models(request):
        if args.models_body:
            return web.Response(text=args.models_body, content_type="application/json")
        return web.json_response({"object": "list", "data": [{"id": args.model, "object": "model"}]})

    async def complete(request):
        body = await request.json()
        if body.get("model") != args.model:
            return web.json_response({"error": {"message": f"The model `{body.get('model')}` does not exist."}},
                                     status=404)
        if args.reject_ignore_eos and "ignore_eos" in body:
            return web.json_response({"error": {"message": "Unrecognized request argument: ignore_eos"}},
                                     status=400)
        if args.fail_all:
            return web.json_response({"error": {"message": "engine is asleep"}}, status=500)
        state["completions"] += 1
        good = state["completions"] <= args.good_first
        if args.error_bytes and not good:
            return await huge_error(request)
        chat = request.path.endswith("chat/completions")
        text = body["messages"][-1]["content"] if chat else body["prompt"]
        prompt_tokens = len(text.split()) + 1
        state["prompt"] += prompt_tokens
        state["queries"] += prompt_tokens
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        state["running"] += 1
        state["open"] += 1
        state["peak"] = max(state["peak"], state["open"])
        decode, prefill = sim.speeds()
        delay = GOOD_TOKEN_DELAY if good else args.token_delay / decode
        tokens = 10**9 if args.endless and not good else body["max_tokens"]
        prefill_s = prompt_tokens * args.prefill_ms / 1e3 / prefill if args.prefill_ms and not good else 0.0
        key = object()
        sim.opened(key, prefill_s, tokens * delay)
        end = asyncio.get_running_loop().time() + ENDLESS_S  # endless: until the client hangs up, or an hour
        try:
            if prefill_s:
                await pause(request, prefill_s)
            for _ in range(tokens):
                if asyncio.get_running_loop().time() > end:
                    break
                await pause(request, delay)
                state["generated"] += 1
                delta = {"delta": {"content": "tok "}} if chat else {"text": "tok "}
                chunk = {"id": "x", "choices": [{"index": 0, **delta, "finish_reason": None}]}
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": body["max_tokens"]}
            event = json.dumps({'id': 'x', 'choices': [], 'usage': usage})
            await response.write(f"data: {args.usage_event if args.usage_event and not good else event}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
        except ConnectionError:  # the client hung up (aiohttp's ClientConnectionResetError is one too)
            pass
        finally:
            state["running"] -= 1
            state["open"] -= 1
            sim.closed(key)
        return response

    async def huge_error(request):
        prefix, suffix = b'{"error": {"message": "', b'"}}'
        response = web.StreamResponse(status=500, headers={"Content-Type": "application/json"})
        await response.prepare(request)
        left = args.error_bytes - len(prefix) - len(suffix)
        block = b"x" * (1 << 20)
        try:
            await response.write(prefix)
            while left > 0:  # a write waits (drains) while the client is not reading: what is counted went out
                piece = block[:left]
                await response.write(piece)
                state["error_bytes_sent"] += len(piece)
                left -= len(piece)
            await response.write(suffix)
        except ConnectionError:  # the client hung up (aiohttp's ClientConnectionResetError is one too)
            pass
        return response

    async def metrics(request):
        lines = [f'vllm:generation_tokens_total{{model_name="{args.model}"}} {state["generated"]}',
                 f'vllm:prompt_tokens_total{{model_name="{args.model}"}} {state["prompt"]}',
                 f'vllm:num_requests_running{{model_name="{args.model}"}} {state["running"]}',
                 f'vllm:num_requests_waiting{{model_name="{args.model}"}} 0',
                 f'vllm:kv_cache_usage_perc{{model_name="{args.model}"}} {min(1.0, state["running"] / 64)}',
                 f'vllm:prefix_cache_queries_total{{model_name="{args.model}"}} {state["queries"]}',
                 f'vllm:prefix_cache_hits_total{{model_name="{args.model}"}} {state["hits"]}']
        return web.Response(text="\n".join(lines) + "\n")

    async def tokenize(request):  # vLLM's /tokenize: one token per word, + 1 for BOS with special tokens
        body = await request.json()
        return web.json_response({"count": len(body["prompt"].split()) + (1 if body.get("add_special_tokens", True)
                                                                           else 0)})

    async def debug_open(request):
        return web.json_response({"open": state["open"], "peak": state["peak"],
                                  "error_bytes_sent": state["error_bytes_sent"]})

    app = web.Application()
    app.add_routes([web.get("/v1/models", models), web.post("/v1/completions", complete),
                    web.post("/v1/chat/completions", complete), web.get("/metrics", metrics),
                    web.get("/debug/open", debug_open)])
    if args.tokenize:
        app.router.add_post("/tokenize", tokenize)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="fake-model")
    parser.add_argument("--token-delay", type=float, default=0.002)
    parser.add_argument("--reject-ignore-eos", action="store_true")
    parser.add_argument("--fail-all", action="store_true")
    parser.add_argument("--tokenize", action="store_true", help="serve /tokenize, as vLLM does")
    parser.add_argument("--endless", action="store_true", help="streams that never end (an hour of tokens)")
    parser.add_argument("--error-bytes", type=int, default=0, help="answer completions with a 500 of this many bytes")
    parser.add_argument("--usage-event", help="send this as the usage event's data")
    parser.add_argument("--models-body", help="answer /v1/models with this")
    parser.add_argument("--good-first", type=int, default=0, metavar="N",
                        help="serve the first N completion requests well, whatever the modes above")
    parser.add_argument("--sim-state", type=Path, metavar="DIR",
                        help="serve at the simulated cards' speed (the simulator's GPUWARDEN_SIM_STATE)")
    parser.add_argument("--prefill-ms", type=float, default=0.0, help="with --sim-state: ms per prompt token")
    parser.add_argument("--sim-gpu", type=int, metavar="N",
                        help="with --sim-state: serve on this simulated card alone (its speed; only it busy)")
    args = parser.parse_args()
    web.run_app(make_app(args), host="127.0.0.1", port=args.port, print=lambda *a: print("listening", flush=True),
                backlog=2048)


if __name__ == "__main__":
    main()
