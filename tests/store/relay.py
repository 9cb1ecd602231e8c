"""A TCP relay in front of Postgres that tests switch off, stall and slow down.

Faults at the process boundary the gateway shares with its database: ``down()`` refuses
new connections and cuts the open ones (an outage), ``stall()`` keeps every connection
open but moves no byte until ``resume()`` (a network partition, a hung pooler), and
``close_delay_s`` holds a connection's client side open that long after the server closed
it, so a termination notice arrives well before the close (what a pooler or a slow link
in between does, and what a busy event loop does on its own for one iteration).
"""

from __future__ import annotations

import asyncio
import contextlib


class TcpRelay:
    """Forwards 127.0.0.1:<port> to 127.0.0.1:<target_port>."""

    def __init__(self, target_port: int, *, close_delay_s: float = 0.0) -> None:
        self.target_port = target_port
        self.close_delay_s = close_delay_s
        self.server: asyncio.Server | None = None
        self.port = 0
        self._conns: set[asyncio.StreamWriter] = set()
        self._upstream: set[asyncio.StreamWriter] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()

    async def up(self) -> None:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self.server.sockets[0].getsockname()[1]

    async def down(self) -> None:
        assert self.server is not None
        self.server.close()
        for w in list(self._conns):
            w.close()
        await self.server.wait_closed()

    def upstream_ports(self) -> list[int]:
        """The local ports of the relay's connections to the server (``client_port`` in
        ``pg_stat_activity``): which backends serve the clients behind this relay."""
        return [w.get_extra_info("sockname")[1] for w in self._upstream]

    def stall(self) -> None:
        """Hold every byte (both ways, new connections too) until :meth:`resume`."""
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter,
                    delay_close: bool) -> None:
        with contextlib.suppress(Exception):
            while data := await r.read(65536):
                await self._flowing.wait()
                w.write(data)
                await w.drain()
        if delay_close and self.close_delay_s:
            await asyncio.sleep(self.close_delay_s)
        w.close()

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await self._flowing.wait()
        try:
            tr, tw = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            w.close()
            return
        self._conns.update((w, tw))
        self._upstream.add(tw)
        await asyncio.gather(self._pipe(r, tw, False), self._pipe(tr, w, True))
        self._conns.difference_update((w, tw))
        self._upstream.discard(tw)
