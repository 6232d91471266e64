"""A small OpenAI-style server that is a real Ray driver, for the Ray backend's supervision test.

vLLM's CPU build cannot run its Ray executor: a platform whose ray_device_key is "" does not support Ray
(vllm/platforms/interface.py:147-150), CpuPlatform (vllm/platforms/cpu.py) keeps it, and
initialize_ray_cluster raises "current platform cpu does not support ray" (vllm/v1/executor/ray_utils.py:572-575).
So on CPU this stands where `vllm serve --distributed-executor-backend ray` stands on GPUs, and behaves as it
does there: it takes the flags the daemon composes (and vLLM's parser accepts), joins the cluster at
RAY_ADDRESS, waits until --tensor-parallel-size nodes are alive (vLLM's placement group waits so), answers
/health while they are, runs a completion as one Ray task on each node, and exits when a node of its group is
lost (vLLM's engine dies with the actor on it). Everything around it, the Ray nodes included, is real.
"""

import argparse
import http.server
import json
import os
import sys
import threading
import time

import ray


def alive_nodes() -> list[str]:
    return sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])


def alive_ids() -> set[str]:
    """By node ID: a node restarted on the same address is a new node, and the group lost the old one."""
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    args, _ = parser.parse_known_args()
    ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)
    while len(alive_nodes()) < args.tensor_parallel_size:
        print(f"INFO waiting for {args.tensor_parallel_size} Ray nodes, have {alive_nodes()}", flush=True)
        time.sleep(2)
    group = alive_nodes()
    group_ids = alive_ids()
    print(f"INFO serving {args.model} on Ray nodes {group}", flush=True)

    @ray.remote(num_cpus=0)
    def where() -> str:
        return ray.util.get_node_ip_address()

    def watch() -> None:
        while True:
            time.sleep(1)
            if group_ids - alive_ids():
                print(f"ERROR a Ray node of the group {group} died: engine dead", flush=True)
                os._exit(1)

    class Handler(http.server.BaseHTTPRequestHandler):
        def reply(self, code: int, body: bytes, kind: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/health":
                self.reply(200, b"")
            elif self.path == "/metrics":
                self.reply(200, b"", "text/plain")
            else:
                self.reply(404, b"")

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            tasks = [where.options(scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                node_id=n["NodeID"], soft=False)).remote() for n in ray.nodes() if n["Alive"]]
            text = " ".join(sorted(ray.get(tasks, timeout=60)))
            self.reply(200, json.dumps({"choices": [{"index": 0, "text": text}]}).encode())

        def log_message(self, *_: object) -> None:
            pass

    threading.Thread(target=watch, daemon=True).start()
    server = http.server.ThreadingHTTPServer((args.host, args.port), Handler)
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
