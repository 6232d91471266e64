"""A local user who squats the engine's port (issue 51, finding 2): run as another uid than the engine's.

    python squatter.py --port P [--host 127.0.0.1]

It says `TRYING` once its loop runs, then tries bind() on HOST:PORT with SO_REUSEADDR every millisecond until it gets
the port (the engine's socket is gone: a crash, a restart), saying `REFUSED <errno name>` the first time a bind fails
with each errno; once bound it says `BOUND` on stdout, and then answers every request 200 (`/health` included) while it
records on stdout each connection (`CONN`) and every byte it is sent (`DATA <base64>`). It runs until killed.
"""

from __future__ import annotations

import argparse
import base64
import errno
import socket
import sys
import threading
import time

LOCK = threading.Lock()


def say(line: str) -> None:
    with LOCK:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def serve(conn: socket.socket) -> None:
    with conn:
        conn.settimeout(30)
        seen = b""
        try:
            while True:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                say("DATA " + base64.b64encode(chunk).decode())
                seen += chunk
                if b"\r\n\r\n" in seen:  # a head: answered as a healthy engine would, whatever it asked
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
                                 b"Connection: close\r\n\r\n{}")
                    return
        except OSError:
            return


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    refused = set()
    say("TRYING")
    while True:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((args.host, args.port))
            sock.listen(64)
            break
        except OSError as exc:
            sock.close()
            if exc.errno not in refused:
                refused.add(exc.errno)
                say(f"REFUSED {errno.errorcode.get(exc.errno, exc.errno)}")
            time.sleep(0.001)
    say("BOUND")
    while True:
        conn, _ = sock.accept()
        say("CONN")
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    main()
