"""An HTTP proxy in front of moto's S3 for the data set copy's tests: it relays every request
as it is, except that it can answer the next GETs with a 5xx (S3 throttling a fleet that starts
together) and can drop the Range header, as a store that ignores Range does (it then answers
200 with the whole object). A TCP proxy (faultproxy.py) cannot say either."""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from conftest import free_port

_SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
              b"<Message>Please reduce your request rate.</Message></Error>")
_INTERNAL = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code>'
             b"<Message>We encountered an internal error. Please try again.</Message></Error>")


class S3Faults:
    def __init__(self, upstream_port: int) -> None:
        self.upstream = upstream_port
        self.failures: list[int] = []  # statuses the next GETs are answered with, in order
        self.ignore_range = False
        self.gets = 0  # GETs seen, failed ones included
        faults = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                faults.gets += 1
                if faults.failures:
                    status = faults.failures.pop(0)
                    body = _SLOW_DOWN if status == 503 else _INTERNAL
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self._relay()

            def do_HEAD(self) -> None:
                self._relay()

            def do_PUT(self) -> None:
                self._relay()

            def _relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: v for k, v in self.headers.items()
                           if not (faults.ignore_range and k.lower() == "range")}
                conn = http.client.HTTPConnection("127.0.0.1", faults.upstream, timeout=60)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    answer = conn.getresponse()
                    data = answer.read()
                finally:
                    conn.close()
                self.send_response(answer.status)
                for k, v in answer.getheaders():  # a HEAD keeps the object's Content-Length
                    if k.lower() not in ("transfer-encoding", "connection") and not (
                            k.lower() == "content-length" and self.command != "HEAD"):
                        self.send_header(k, v)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> S3Faults:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
