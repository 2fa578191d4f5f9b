"""A TCP proxy on 127.0.0.1 that sits between a client and the gateway and injects faults.

One HTTP request per connection (``Connection: close`` is forced both ways). Faults are queued with
:meth:`FaultProxy.inject` and consumed by the next matching requests:

- ``stall``: hold the request until the client gives up on it (closes the connection), then forward
  it: a gateway slower than the client's timeout, however long that is and however loaded the
  machine (a fixed delay is outlasted by a slow client);
- ``reset``: reset the connection before forwarding (the request is provably not applied);
- ``reset_after``: forward, let the gateway apply it, then reset instead of answering (ambiguous);
- ``503``: answer 503 without forwarding.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections import Counter

import attrs

ACTIONS = ("stall", "reset", "reset_after", "503")
STALL_LIMIT_S = 300.0  # a client that never gives up is released after this long


@attrs.define
class _Fault:
    action: str
    remaining: int
    path_contains: str | None


def _read_request(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def _force_close(message: bytes) -> bytes:
    head, _, body = message.partition(b"\r\n\r\n")
    lines = [line for line in head.split(b"\r\n") if not line.lower().startswith(b"connection:")]
    return b"\r\n".join([*lines, b"Connection: close"]) + b"\r\n\r\n" + body


def _wait_for_close(conn: socket.socket) -> None:
    """Block until the client closes ``conn`` (it sent its whole request, so reading sees only EOF)."""
    conn.settimeout(STALL_LIMIT_S)
    try:
        while conn.recv(65536):
            pass
    except OSError:
        pass


def _reset(conn: socket.socket) -> None:
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()


class FaultProxy:
    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._faults: list[_Fault] = []
        self._lock = threading.Lock()
        self.applied: Counter[str] = Counter()
        self.requests = 0
        self._thread = threading.Thread(target=self._serve, name="fault-proxy", daemon=True)

    def inject(self, action: str, count: int = 1, *, path_contains: str | None = None) -> None:
        if action not in ACTIONS:
            raise ValueError(f"unknown fault {action!r}; known: {ACTIONS}")
        with self._lock:
            self._faults.append(_Fault(action, count, path_contains))

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()

    def _take(self, request_line: str) -> _Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.remaining > 0 and (fault.path_contains is None or fault.path_contains in request_line):
                    fault.remaining -= 1
                    self.applied[fault.action] += 1
                    return fault
        return None

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._listener.close()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            request = _read_request(conn)
            if not request:
                conn.close()
                return
            self.requests += 1
            fault = self._take(request.split(b"\r\n", 1)[0].decode("latin-1"))
            action = fault.action if fault else None
            if action == "reset":
                _reset(conn)
                return
            if action == "503":
                body = b'{"detail":"injected 503"}'
                conn.sendall(
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                    + body
                )
                conn.close()
                return
            if action == "stall":
                _wait_for_close(conn)
            with socket.create_connection(("127.0.0.1", self.upstream_port), timeout=30) as upstream:
                upstream.sendall(_force_close(request))
                response = b""
                while chunk := upstream.recv(65536):
                    response += chunk
            if action == "reset_after":
                _reset(conn)
                return
            conn.sendall(_force_close(response))
            conn.close()
        except OSError:
            conn.close()
