"""A reward service on this machine, for the tests and the benchmark of the reward's calls: each request
(`GET /{answer}/{completion}`) takes `latency` seconds, as a verifier or a reward model behind HTTP does, and
answers {"score": 1.0} when the completion is the answer; it counts the requests in flight at once."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import quote
from urllib.request import urlopen


class RewardService(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # many calls connect at once

    def __init__(self, latency: float = 0.05):
        self.latency, self.in_flight, self.most, self.lock = latency, 0, 0, threading.Lock()
        super().__init__(("127.0.0.1", 0), _Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def score(self, answer: str, completion: str) -> float:
        """A client's call: what a user's reward function does (one request a sample)."""
        with urlopen(f"{self.url}/{quote(answer, safe='')}/{quote(completion, safe='')}", timeout=30) as r:
            return json.load(r)["score"]

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        service: RewardService = self.server
        with service.lock:
            service.in_flight += 1
            service.most = max(service.most, service.in_flight)
        time.sleep(service.latency)
        with service.lock:
            service.in_flight -= 1
        answer, completion = self.path.strip("/").split("/")
        body = json.dumps({"score": float(answer == completion)}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass
