"""A stand-in for ``python -m vllm.entrypoints.openai.api_server``, for process tests.

It takes the launcher's argv (``--host``, ``--port``, ``--served-model-name``; the rest
is ignored), starts an "engine core" child with ``multiprocessing`` (spawn, as vLLM does,
so there is a resource tracker too), then answers ``/health``, ``/v1/models``,
``/metrics`` and non-streamed chat completions in vLLM's shape, and, as vLLM does only
when started with ``VLLM_SERVER_DEV_MODE=1``, its weight-version and pause routes
(``/weight_info``, ``/update_weight_version``, ``/is_paused``; the other control routes
just answer 200). Environment knobs (set through the pool spec's ``launcher.env``):
``STANDIN_DELAY_S`` seconds before it binds its port (vLLM loading), ``STANDIN_EXIT`` an
exit status to leave with at once (a start that fails). The engine core does not watch
its parent: when the API server dies it lives on, as an orphaned engine would.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def engine_core() -> None:
    while True:
        time.sleep(1)


CONTROL = ("/pause", "/resume", "/abort_requests", "/collective_rpc", "/reset_prefix_cache")


def handler(model: str, dev_mode: bool) -> type[BaseHTTPRequestHandler]:
    weights = {"weight_version": "default"}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _json(self, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self._json({"object": "list", "data": [{"id": model, "object": "model"}]})
            elif dev_mode and self.path == "/weight_info":
                self._json(weights)
            elif dev_mode and self.path == "/is_paused":
                self._json({"is_paused": False})
            elif self.path in ("/health", "/metrics"):
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()
            else:
                self.send_error(404)

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            route = self.path.split("?")[0]
            if dev_mode and route == "/update_weight_version":
                weights["weight_version"] = json.loads(body)["new_version"]
                self._json({"success": True, **weights})
                return
            if dev_mode and route in CONTROL:
                self._json({"success": True})
                return
            if self.path != "/v1/chat/completions":
                self.send_error(404)
                return
            ids = [7, 8, 9]
            self._json({
                "id": f"chatcmpl-{os.getpid()}", "object": "chat.completion", "model": model,
                "created": int(time.time()), "prompt_token_ids": [1, 2, 3],
                "choices": [{"index": 0, "finish_reason": "length", "token_ids": ids,
                             "message": {"role": "assistant", "content": f"pid {os.getpid()}"},
                             "logprobs": {"content": [
                                 {"token": "x", "logprob": -0.5, "bytes": [120],
                                  "top_logprobs": []} for _ in ids]}}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
            })

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-m")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--served-model-name", default="tiny")
    args, _ = parser.parse_known_args()
    if os.environ.get("STANDIN_EXIT"):
        print("stand-in: failing on purpose", flush=True)
        sys.exit(int(os.environ["STANDIN_EXIT"]))
    core = multiprocessing.get_context("spawn").Process(target=engine_core, daemon=False)
    core.start()
    time.sleep(float(os.environ.get("STANDIN_DELAY_S") or 0))
    dev_mode = os.environ.get("VLLM_SERVER_DEV_MODE") == "1"
    server = ThreadingHTTPServer((args.host, args.port),
                                 handler(args.served_model_name, dev_mode))
    print(f"stand-in engine {os.getpid()} (core {core.pid}) on port {args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
