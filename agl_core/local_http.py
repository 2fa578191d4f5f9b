"""The small stdlib HTTP layer under agl's in-process servers (the policy server, the embedded gateway).

Both answer JSON on 127.0.0.1 to a whole batch of concurrent agents; this module is the one place
that knows how to frame a JSON response and how deep the listen backlog must be.
"""

from __future__ import annotations

import json
import logging
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger(__name__)


class LocalHTTPServer(ThreadingHTTPServer):
    """A threaded HTTP server whose listen backlog holds a whole batch of concurrent agents."""

    daemon_threads = True
    request_queue_size = 1024

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hung up (an agent that stopped waiting) is no server error: logged at debug."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            logger.debug("a client of %s:%s hung up: %s", *self.server_address[:2], sys.exc_info()[1])
            return
        super().handle_error(request, client_address)


class JSONRequestHandler(BaseHTTPRequestHandler):
    """Keep-alive handler with JSON responses; subclasses implement ``do_GET`` / ``do_POST``."""

    protocol_version = "HTTP/1.1"
    server_label = "local server"  # how request logs name the server

    def read_body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("content-length") or 0))

    def send_json(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except ConnectionError:  # the client gave up waiting: nobody to answer
            self.close_connection = True
            logger.debug(
                "%s: the client of %s %s went away before its answer", self.server_label, self.command, self.path
            )

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug(self.server_label + ": " + format, *args)
