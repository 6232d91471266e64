"""A misbehaving stand-in for vLLM, run as a real process by the fault tests and the soak benchmark.

    python fakechild.py --mode MODE[,MODE...] [the engine's flags ... --host H --port P | --uds PATH]

It takes what gpuwarden appends (--model ..., --host, --port, or --uds: then it binds that Unix socket and no TCP
port, as vLLM 0.32 does) and ignores the rest, but for a flag that starts with
--no-such-: it refuses that one as vLLM's parser refuses an unknown flag (one line on stderr, exit 2), as
tests/harness/fakechild-flagcheck does.
Modes:
  healthy      /health 200 and a small vLLM /metrics whose counters grow (the default)
  sglang       speaks as SGLang: needs --model-path and --enable-metrics (else exits 2, as its parser
               would), logs in its format, and serves its sglang: metric names
  trickle      /metrics answers one byte a second
  huge         /metrics sends a 1 GB body
  noaccept     binds and listens, never accepts (vLLM while it loads a model)
  loading      as noaccept until SIGUSR1 (the model loaded, when the test says so), then serves as healthy
  nan          /metrics says NaN and +Inf for the request gauges
  flood        prints one 200 MB line with no newline, then serves as healthy
  lines        prints LINES short lines as fast as it can, then "INFO fakechild lines done", serving as healthy
  ignore-term  ignores SIGTERM
  setsid       forks a grandchild that calls setsid() and sleeps: it leaves the process group
  doublefork   forks a child that forks a grandchild and exits at once
  engine       forks a child that stays in its process group, as vLLM's EngineCore does (a SIGKILL of the
               server leaves it for the group kill)
  crash        exits with status 3 after 1 s
  chatty       prints "INFO fakechild tick N" every 0.3 s (is its output still read after a handover?)
  controls     prints one line with NUL, CR, ESC and a forged `<0>` record in it, then serves as healthy
  drain        answers GET /v1/... after 3 s (?s=N: N s; ?gate=1: once GET /debug/release came, 300 s at most: the
               test, not the clock, says when a request in flight ends), counted as running in /metrics; at
               SIGTERM it drains as vLLM does with --shutdown-timeout N: new requests get 500 (its /health 200),
               it exits once those in flight finished or N s passed (without the flag, or 0: it exits at once,
               aborting them, as vLLM does)
  stuck-drain  as drain, but its requests never finish and SIGTERM never ends it: a drain that never ends
  answer       POST /v1/completions answers a completion whose text is what --answer-file holds when asked (the
               known-answer check: a test changes the file to make a restarted engine compute something else)
  killer       /v1/... reads its body: one with QOD-NOW in it (or in its path) ends the process at once, unanswered
               (a query of death); QOD-MIDSTREAM gets a stream's head and one event first, then the same end;
               QOD-SLOW closes the connection unanswered and ends the process 2 s later, its /health 200 meanwhile
               (an engine whose death takes its time); any other body gets a small chat completion, 200 (the prompt
               is never printed).
               QOD-500 ends it as vLLM 0.32 ends when its EngineCore dies: the request is answered 500 with vLLM's
               error body, /health answers 503 and every request 500 from then on, and the process ends (status 4)
               1 s later; QOD-500-STREAM the same, as a stream: its head, one event, vLLM's error event, [DONE]
  tokens       POST /v1/completions with a JSON body {"prompt_tokens": P, "output_tokens": O, "prefill_s": A,
               "decode_s": B, "stream": false, "usage": true} answers as vLLM would have computed it: after A s its
               first byte, O tokens over B s (a stream: one event each, spaced), then its usage (a stream: as its last
               event, where "usage" is true), P and O as asked (joules per request: a known schedule)
--start-gate PATH: the process does not listen while PATH exists (120 s at most): a test holds the next engine back
               until the proxy has judged the last one's end, which a busy box's fast restart would otherwise race
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
import urllib.parse

METRICS = """# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{engine="0",model_name="m"}} {gen}
vllm:prompt_tokens_total{{engine="0",model_name="m"}} {prompt}
vllm:num_requests_running{{engine="0",model_name="m"}} {running}
vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}
vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} 0.1
"""


DRAINERS = {"drain", "stuck-drain"}
ANSWER_FILE = [""]  # answer mode: where the completion's text is read
IN_FLIGHT = [0]  # the slow requests being answered (drain modes)
IN_FLIGHT_LOCK = threading.Lock()
DRAINING = threading.Event()  # SIGTERM came
RELEASED = threading.Event()  # GET /debug/release: the gated slow requests end
LOADED = threading.Event()  # loading mode: set by SIGUSR1
DEAD = threading.Event()  # killer mode: its engine died on a QOD-500 request; the server answers 500 until it ends
# vLLM 0.32's answer once its EngineCore is dead: EngineDeadError's message through create_error_response, the same
# JSON as a stream's last event (entrypoints/serve/exception_handling/error_response.py)
ENGINE_DEAD = json.dumps({"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the root "
                                               "cause.", "type": "InternalServerError", "param": None, "code": 500}})


SGLANG_METRICS = """# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{{model_name="m"}} {gen}
sglang:prompt_tokens_total{{model_name="m"}} {prompt}
sglang:num_running_reqs{{model_name="m"}} {running}
sglang:num_queue_reqs{{model_name="m"}} {waiting}
sglang:token_usage{{model_name="m"}} 0.2
"""


def answer(conn: socket.socket, modes: set[str], started: float) -> None:
    with conn:
        conn.settimeout(30)
        request = b""
        while b"\r\n\r\n" not in request:
            chunk = conn.recv(4096)
            if not chunk:
                return
            request += chunk
        path = request.split(b" ", 2)[1].decode()
        if path == "/debug/release":  # the gated slow requests (drain modes) end now
            RELEASED.set()
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            return
        if path == "/health":
            status = b"503 Service Unavailable" if DEAD.is_set() else b"200 OK"  # vLLM: 503 once its engine died
            conn.sendall(b"HTTP/1.1 %s\r\nContent-Length: 0\r\nConnection: close\r\n\r\n" % status)
            return
        if path == "/v1/completions" and "answer" in modes:
            with open(ANSWER_FILE[0], encoding="utf-8") as f:
                body = json.dumps({"object": "text_completion", "choices": [{"index": 0, "text": f.read()}]}).encode()
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
            return
        if path == "/v1/completions" and "tokens" in modes:
            tokens(conn, request)
            return
        if path.startswith("/v1/") and "killer" in modes:
            killer(conn, request)
            return
        if path.startswith("/v1/") and modes & DRAINERS:
            slow_request(conn, path, modes)
            return
        if path != "/metrics":
            conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            return
        if "huge" in modes:
            size = 1 << 30
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % size)
            block = b"# " + b"x" * 65533 + b"\n"
            for _ in range(size // len(block)):
                conn.sendall(block)
            return
        gen = int((time.monotonic() - started) * 100)
        running, waiting = ("NaN", "+Inf") if "nan" in modes else ("2", "0")
        if modes & DRAINERS:
            running = str(IN_FLIGHT[0])
        text = SGLANG_METRICS if "sglang" in modes else METRICS
        body = text.format(gen=gen, prompt=gen // 2, running=running, waiting=waiting).encode()
        head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
        if "trickle" in modes:
            for byte in head + body:
                conn.sendall(bytes([byte]))
                time.sleep(1)
            return
        conn.sendall(head + body)


def read_body(conn: socket.socket, request: bytes) -> tuple[bytes, bytes] | None:
    """(head, body) of a request whose head is read: the body read whole (Content-Length); None: the client left."""
    head, _, body = request.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        body += chunk
    return head, body


def tokens(conn: socket.socket, request: bytes) -> None:
    """tokens mode: a completion made to the body's measure (its docstring above)."""
    whole = read_body(conn, request)
    if whole is None:
        return
    ask = json.loads(whole[1])
    prompt, output = int(ask.get("prompt_tokens", 0)), int(ask.get("output_tokens", 0))
    usage = {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output}
    time.sleep(float(ask.get("prefill_s", 0)))
    if not ask.get("stream"):
        time.sleep(float(ask.get("decode_s", 0)))
        answer_body = json.dumps({"object": "text_completion", "choices": [{"index": 0, "text": "x" * output}],
                                  **({"usage": usage} if ask.get("usage", True) else {})}).encode()
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                     b"Connection: close\r\n\r\n%s" % (len(answer_body), answer_body))
        return
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                 b"Connection: close\r\n\r\n")

    def send(event: bytes) -> None:
        conn.sendall(b"%x\r\n%s\r\n" % (len(event), event))

    events = [b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n'] * output
    if ask.get("usage", True):
        events.append(b'data: %s\n\n' % json.dumps({"choices": [], "usage": usage}).encode())
    for event in events:
        send(event)
        time.sleep(float(ask.get("decode_s", 0)) / max(1, output))
    send(b"data: [DONE]\n\n")
    conn.sendall(b"0\r\n\r\n")


def killer(conn: socket.socket, request: bytes) -> None:
    """killer mode: the body read whole (Content-Length); a query of death ends the process (exit status 4)."""
    whole = read_body(conn, request)
    if whole is None:
        return
    head, body = whole
    body = head.split(b"\r\n", 1)[0] + b"\n" + body  # the request line: a GET's path may carry the marker too
    if DEAD.is_set() or b"QOD-500" in body:
        answered_then_died(conn, stream=b"QOD-500-STREAM" in body and not DEAD.is_set())
        return
    if b"QOD-MIDSTREAM" in body:
        event = b'data: {"choices": [{"index": 0, "delta": {"content": "Hel"}}]}\n\n'  # chunked, as uvicorn streams
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                     b"Connection: close\r\n\r\n%x\r\n%s\r\n" % (len(event), event))
        time.sleep(0.3)
    elif b"QOD-SLOW" in body:
        conn.close()
        time.sleep(2)
    if b"QOD-" in body:
        print("ERROR fakechild: a request ended me (a query of death)", flush=True)
        os._exit(4)
    answer_body = json.dumps({"object": "chat.completion", "choices": [{"index": 0, "message": {
        "role": "assistant", "content": "fine"}}]}).encode()
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                 b"Connection: close\r\n\r\n%s" % (len(answer_body), answer_body))


def answered_then_died(conn: socket.socket, stream: bool) -> None:
    """As vLLM 0.32's API server when its EngineCore dies: the request in flight answered 500 with the engine-dead
    error (a stream: the error as its last event, then [DONE]), and every one after it (add_request raises
    EngineDeadError), /health 503, and the process ends a moment later (its server stops: 1 s here)."""
    first = not DEAD.is_set()
    DEAD.set()
    if stream:
        events = [b'data: {"choices": [{"index": 0, "delta": {"content": "Hel"}}]}\n\n',
                  b"data: %s\n\n" % ENGINE_DEAD.encode(), b"data: [DONE]\n\n"]
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                     b"Connection: close\r\n\r\n" + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events)
                     + b"0\r\n\r\n")
    else:
        body = ENGINE_DEAD.encode()
        conn.sendall(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\nContent-Length: %d"
                     b"\r\nConnection: close\r\n\r\n%s" % (len(body), body))
    if first:
        print("ERROR fakechild: a request ended my engine (a query of death): answered 500, ending", flush=True)
        threading.Timer(1.0, os._exit, (4,)).start()


def slow_request(conn: socket.socket, path: str, modes: set[str]) -> None:
    """A request that takes its time (drain modes); refused once SIGTERM came, as a draining vLLM 0.32 refuses: 500,
    its /health still 200 (its executor is shut down: entrypoints/launchers/launcher.py)."""
    if DRAINING.is_set():
        body = b'{"error":{"message":"cannot schedule new futures after shutdown","code":500}}'
        conn.sendall(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                     % (len(body), body))
        return
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query)
    seconds = float(query.get("s", ["3"])[0])
    with IN_FLIGHT_LOCK:
        IN_FLIGHT[0] += 1
    try:
        if "stuck-drain" in modes:
            threading.Event().wait()  # never answered
        if query.get("gate") == ["1"]:  # released once for the process: every gated request after it ends at once
            RELEASED.wait(300)
        else:
            time.sleep(seconds)
        body = b'{"done": true}'
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
    finally:
        with IN_FLIGHT_LOCK:
            IN_FLIGHT[0] -= 1


def drain_at_sigterm(timeout: int, modes: set[str]) -> None:
    """vLLM's drain (v1/engine/core.py _handle_shutdown): 0 aborts at once; N lets the requests in flight finish
    within N s. stuck-drain never ends."""
    def finish() -> None:
        deadline = time.monotonic() + timeout
        while IN_FLIGHT[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        print(f"INFO fakechild drain over, {IN_FLIGHT[0]} requests left", flush=True)
        os._exit(0)

    def on_term(_signum, _frame) -> None:
        if DRAINING.is_set():
            return
        DRAINING.set()
        print(f"INFO fakechild SIGTERM: draining {IN_FLIGHT[0]} requests, up to {timeout} s", flush=True)
        if "stuck-drain" in modes:
            return
        if timeout <= 0:
            os._exit(0)
        threading.Thread(target=finish, daemon=True).start()

    signal.signal(signal.SIGTERM, on_term)


def serve(host: str, port: int, modes: set[str], uds: str | None = None) -> None:
    if uds:  # vLLM's create_server_unix_socket: bind the path (a file already there: EADDRINUSE)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(uds)
    else:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
    listener.listen(8)
    started = time.monotonic()
    if "noaccept" in modes:
        while True:
            time.sleep(3600)
    while "loading" in modes and not LOADED.is_set():
        time.sleep(0.05)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=answer, args=(conn, modes, started), daemon=True).start()


def leave_the_group(modes: set[str]) -> None:
    if "engine" in modes and os.fork() == 0:  # stays in the group: what the supervisor's group kill ends
        while True:
            time.sleep(3600)
    if "setsid" in modes and os.fork() == 0:
        os.setsid()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            time.sleep(3600)
    if "doublefork" in modes and os.fork() == 0:
        if os.fork() == 0:
            os.setsid()
            while True:
                time.sleep(3600)
        os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="healthy")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--uds")  # vLLM's: listen on this Unix socket, --host and --port ignored
    parser.add_argument("--model-path")
    parser.add_argument("--enable-metrics", action="store_true")
    parser.add_argument("--shutdown-timeout", type=int, default=0)  # vLLM's drain (0.18 and later)
    parser.add_argument("--answer-file", default="")
    parser.add_argument("--start-gate", default="")
    args, rest = parser.parse_known_args()
    refused = [flag for flag in rest if flag.startswith("--no-such-")]
    if refused:
        print(f"vllm serve: error: unrecognized arguments: {' '.join(refused)}", file=sys.stderr, flush=True)
        sys.exit(2)
    ANSWER_FILE[0] = args.answer_file
    modes = set(args.mode.split(","))
    if "sglang" in modes:
        if not (args.model_path and args.enable_metrics):
            print("launch_server: error: the following arguments are required: --model-path, --enable-metrics",
                  file=sys.stderr, flush=True)
            sys.exit(2)
        print(time.strftime("[%Y-%m-%d %H:%M:%S TP0] ") + f"Load weight begin. model {args.model_path}", flush=True)
    if "ignore-term" in modes:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if "loading" in modes:  # before its first line: a test that saw it may signal at once
        signal.signal(signal.SIGUSR1, lambda *_: LOADED.set())
    if modes & DRAINERS:
        drain_at_sigterm(args.shutdown_timeout, modes)
    where = f"unix:{args.uds}" if args.uds else f"{args.host}:{args.port}"
    print(f"INFO fakechild pid {os.getpid()} modes {sorted(modes)} on {where}", flush=True)
    leave_the_group(modes)
    if "flood" in modes:
        line = b"y" * (1 << 20)
        for _ in range(200):
            sys.stdout.buffer.write(line)
        sys.stdout.buffer.write(b"\n")
        sys.stdout.flush()
    if "lines" in modes:
        out = sys.stdout.buffer
        for n in range(LINES):
            out.write(b"INFO fakechild flood-line %d\n" % n)
        out.write(b"INFO fakechild lines done\n")
        out.flush()
    if "controls" in modes:  # an engine may echo a request's path or a prompt: bytes journald and terminals act on
        sys.stdout.buffer.write(b"WARNING fakechild said: a\x00<0>gpuwarden: GPU0 gpu_needs_reset FORGED\r"
                                b"\x1b[2J\x1b]52;c;Zm9yZ2Vk\x07 end\n")
        sys.stdout.flush()
    if "crash" in modes:
        time.sleep(1)
        print("ERROR fakechild: crashing on purpose", flush=True)
        sys.exit(3)
    if "chatty" in modes:
        threading.Thread(target=tick, daemon=True).start()
    gate_until = time.monotonic() + 120
    while args.start_gate and os.path.exists(args.start_gate) and time.monotonic() < gate_until:
        time.sleep(0.05)
    serve(args.host, args.port, modes, args.uds)


LINES = 200_000  # the lines mode's output: ~6 MB


def tick() -> None:
    n = 0
    while True:
        n += 1
        print(f"INFO fakechild tick {n}", flush=True)
        time.sleep(0.3)


if __name__ == "__main__":
    main()
