"""A plain reverse proxy: the overhead benchmark's floor for "a Python hop in between".

It does at the protocol level what the gateway does on the hot path and nothing else:
an aiohttp server (uvloop) takes a POST, forwards its body unchanged over one pooled
aiohttp client session to the same path on the upstream, and relays the answer back
chunk by chunk as it arrives, streaming or not. No parsing, no tagging, no scheduling,
no token capture, no recording. The gap between it and ``direct`` is what any Python
proxy pays for the extra hop; the gap between the gateway and it is the gateway's own
work.

Run it in its own process: ``python -m bench.harness.plain_proxy --upstream URL --port P``.
"""

from __future__ import annotations

import argparse

import aiohttp
from aiohttp import web

_FORWARD = ("content-type", "authorization", "accept")


def make_app(upstream: str) -> web.Application:
    app = web.Application()

    async def session(app: web.Application):  # type: ignore[no-untyped-def]
        app["session"] = aiohttp.ClientSession(
            # idle connections close before the upstream's own 5 s keep-alive does, as
            # the gateway's do (UpstreamSettings.keepalive_s): no request races that close
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4),
            timeout=aiohttp.ClientTimeout(total=600), auto_decompress=False)
        yield
        await app["session"].close()

    async def health(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARD}
        async with request.app["session"].post(upstream + request.path, data=body,
                                               headers=headers) as up:
            out = web.StreamResponse(status=up.status, headers={
                "content-type": up.headers.get("content-type", "application/json")})
            await out.prepare(request)
            async for chunk in up.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    app.cleanup_ctx.append(session)
    app.router.add_get("/health", health)
    app.router.add_post("/{tail:.*}", forward)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    import uvloop

    uvloop.install()
    web.run_app(make_app(args.upstream.rstrip("/")), host=args.host, port=args.port,
                access_log=None, print=None)


if __name__ == "__main__":
    main()
