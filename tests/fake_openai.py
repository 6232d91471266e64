"""A fake OpenAI-compatible streaming server with vLLM's counters, for `gpuwarden bench` tests.

    python3 tests/fake_openai.py --port P [--model M] [--token-delay S] [--reject-ignore-eos] [--fail-all] [--tokenize]

Prompt tokens are the prompt's words (+1); each output token is one SSE chunk after --token-delay seconds,
then a usage chunk and [DONE]. /metrics counts tokens as vLLM names them; /debug/open says how many streams
are open now (a client that leaves sockets behind shows there).
"""

import argparse
import asyncio
import json

from aiohttp import web

state = {"generated": 0, "prompt": 0, "running": 0, "queries": 0, "hits": 0, "open": 0, "peak": 0}


def make_app(args) -> web.Application:
    async def models(request):
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
        try:
            for i in range(body["max_tokens"]):
                await asyncio.sleep(args.token_delay)
                state["generated"] += 1
                delta = {"delta": {"content": "tok "}} if chat else {"text": "tok "}
                chunk = {"id": "x", "choices": [{"index": 0, **delta, "finish_reason": None}]}
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": body["max_tokens"]}
            await response.write(f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage})}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
        finally:
            state["running"] -= 1
            state["open"] -= 1
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
        return web.json_response({"open": state["open"], "peak": state["peak"]})

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
    args = parser.parse_args()
    web.run_app(make_app(args), host="127.0.0.1", port=args.port, print=lambda *a: print("listening", flush=True),
                backlog=2048)


if __name__ == "__main__":
    main()
