"""A probe server for the lab's own tests: GET /whoami answers the caller's address as this server sees it
(behind NAT: the router's public address); POST / reads and discards the body and answers the byte count
and seconds. Usage: probe_server.py HOST PORT"""
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def _reply(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._reply(f"{self.client_address[0]}".encode())

    def do_POST(self):
        left, t0 = int(self.headers.get("Content-Length", 0)), time.monotonic()
        n = 0
        while left > 0:
            got = self.rfile.read(min(1 << 16, left))
            if not got:
                break
            n, left = n + len(got), left - len(got)
        self._reply(f"{n} {time.monotonic() - t0:.4f}".encode())


if __name__ == "__main__":
    ThreadingHTTPServer((sys.argv[1], int(sys.argv[2])), Handler).serve_forever()
