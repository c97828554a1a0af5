"""A small TCP fault proxy for tests: sits between a client and one upstream (Redis, a server)
and is switched at runtime between

    pass       relay bytes both ways
    refuse     nothing listens: connects fail with ECONNREFUSED; open connections are reset
    blackhole  connects succeed but no byte moves either way, as in a network partition;
               open connections freeze too (they are reset when the mode changes again)
    reset      every connection, open or new, is reset (TCP RST)

and may slow every byte it relays by ``delay`` seconds each way (a long link).

It runs its own asyncio loop in a daemon thread, so a synchronous test drives it with
``proxy.set_mode("blackhole")``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading

from conftest import free_port

MODES = ("pass", "refuse", "blackhole", "reset")


def _rst(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST instead of an orderly FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class _Link:
    """One client connection and, while relaying, its upstream connection and pumps."""

    def __init__(self, client: asyncio.StreamWriter) -> None:
        self.client = client
        self.upstream: asyncio.StreamWriter | None = None
        self.pumps: list[asyncio.Task] = []

    def freeze(self) -> None:
        for pump in self.pumps:
            pump.cancel()
        self.pumps = []

    def drop(self) -> None:
        self.freeze()
        _rst(self.client)
        if self.upstream is not None:
            _rst(self.upstream)


class FaultProxy:
    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1",
                 port: int | None = None) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = port or free_port()
        self.mode = "pass"
        self.links: set[_Link] = set()
        self.server: asyncio.Server | None = None
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                       name="faultproxy")
        self.connections = 0
        self.delay = 0.0  # seconds each relayed chunk is held, either way
        self.relayed = 0  # bytes relayed from the upstream to clients, in all

    def url(self, scheme: str = "redis", path: str = "/0") -> str:
        return f"{scheme}://127.0.0.1:{self.port}{path}"

    # --- control, from the test's thread ------------------------------------------------
    def start(self) -> FaultProxy:
        self.thread.start()
        self._call(self._listen())
        return self

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: use one of {MODES}")
        self._call(self._switch(mode))

    def stop(self) -> None:
        if not self.thread.is_alive():
            return
        self._call(self._shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()

    def _call(self, coro) -> None:
        asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    # --- the loop's side ----------------------------------------------------------------
    async def _listen(self) -> None:
        if self.server is None:
            self.server = await asyncio.start_server(self._accept, "127.0.0.1", self.port,
                                                     reuse_address=True)

    async def _unlisten(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
            self.server = None

    async def _switch(self, mode: str) -> None:
        previous, self.mode = self.mode, mode
        if mode == previous:
            return
        if mode == "refuse":
            await self._unlisten()
        else:
            await self._listen()
        for link in list(self.links):
            if mode == "blackhole" and previous == "pass":
                link.freeze()
            else:
                link.drop()
                self.links.discard(link)

    async def _shutdown(self) -> None:
        await self._unlisten()
        for link in list(self.links):
            link.drop()
        self.links.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self.mode == "reset":
            _rst(writer)
            return
        link = _Link(writer)
        self.links.add(link)
        if self.mode == "blackhole":
            return  # held open, silent, until the mode changes
        try:
            up_reader, link.upstream = await asyncio.open_connection(*self.upstream)
        except OSError:
            link.drop()
            self.links.discard(link)
            return
        if self.mode != "pass" or link not in self.links:
            link.drop()  # the mode changed while we were connecting
            self.links.discard(link)
            return
        link.pumps = [asyncio.create_task(self._pump(reader, link.upstream, link)),
                      asyncio.create_task(self._pump(up_reader, writer, link, down=True))]

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                    link: _Link, down: bool = False) -> None:
        try:
            while data := await src.read(65536):
                if self.delay:
                    await asyncio.sleep(self.delay)
                dst.write(data)
                self.relayed += len(data) if down else 0
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        # One side closed or failed: close both, as a real path between them would.
        link.drop()
        self.links.discard(link)
