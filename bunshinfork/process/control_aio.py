"""The asyncio client of the workspace init's control protocol (wire format: protocol.py).

What control.py does on blocking sockets, on asyncio streams: a request and its reply
frames, one-frame requests, and a command's input. As there, a call returns only once the
init's shim has hung up, so a snapshot right after it finds nothing connected to the host.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Unpack

from .. import inroot
from . import protocol
from .protocol import REPLY_TIMEOUT, Fields


class AsyncConnection:
    """One request to the init and its reply frames (control.Connection on asyncio streams)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._answered = False
        self._eof = False

    @classmethod
    async def open(cls, init_pid: int, timeout: float | None = None) -> AsyncConnection:
        try:
            # The address holds an fd of the socket checked: it must outlive the connect.
            with inroot.bunshin_socket(init_pid, protocol.CTL_SOCK) as address:
                reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(address),
                                                        REPLY_TIMEOUT if timeout is None else timeout)
        except (OSError, TimeoutError) as e:
            raise protocol.not_answering(init_pid, e) from e
        return cls(reader, writer)

    async def send(self, op: str, **fields: Unpack[Fields]) -> None:
        self._writer.write(protocol.encode(op, **fields))
        await self._writer.drain()

    async def send_frame(self, kind: str, data: bytes = b"") -> None:
        self._writer.write(protocol.frame(kind, data))
        await self._writer.drain()

    async def frames(self) -> AsyncIterator[tuple[str, bytes]]:
        """Yield (type, data) until the init closes the connection."""
        while True:
            try:
                hdr = await self._reader.readexactly(protocol.HEADER.size)
                self._answered = True
                kind, length = protocol.header(hdr)
                data = await self._reader.readexactly(length) if length else b""
            except asyncio.IncompleteReadError:
                self._eof = True
                return
            yield kind, data

    async def close(self) -> None:
        """As Connection.close: an answered request is left only once the shim hung up."""
        try:
            if self._answered and not self._eof:
                self._writer.write_eof()
                await asyncio.wait_for(_drain(self._reader), REPLY_TIMEOUT)
        except (OSError, TimeoutError):
            pass
        finally:
            self._writer.close()
            with contextlib.suppress(OSError):
                await self._writer.wait_closed()


async def _drain(reader: asyncio.StreamReader) -> None:
    while await reader.read(protocol.CHUNK):
        pass


async def simple(init_pid: int, op: str, timeout: float | None = None, **fields: Unpack[Fields]) -> str:
    """control.simple on asyncio streams: a request answered by one frame; the X payload."""
    limit = REPLY_TIMEOUT if timeout is None else timeout
    reply = protocol.SimpleReply(init_pid, op)
    conn = await AsyncConnection.open(init_pid, limit)
    try:
        async def exchange() -> None:
            await conn.send(op, **fields)
            async for kind, data in conn.frames():
                reply.feed(kind, data)

        try:
            await asyncio.wait_for(exchange(), limit)
        except TimeoutError:
            raise reply.timed_out(limit) from None
    finally:
        await conn.close()
    return reply.value()


class InputStream:
    """An open connection to command `pid`'s shim: input frames go in order, each acknowledged."""

    def __init__(self, pid: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.pid = pid
        self._reader = reader
        self._writer = writer

    @classmethod
    async def open(cls, init_pid: int, pid: int, timeout: float | None = None) -> InputStream:
        try:
            with inroot.bunshin_socket(init_pid, protocol.input_path(pid)) as address:
                reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(address),
                                                        timeout or REPLY_TIMEOUT)
        except (FileNotFoundError, ConnectionRefusedError):
            raise protocol.no_input(pid) from None
        return cls(pid, reader, writer)

    async def send(self, kind: str, data: bytes = b"") -> None:
        """One frame ('I', 'C' or 'R'), once the shim has acknowledged it."""
        self._writer.write(protocol.frame(kind, data))
        await self._writer.drain()
        try:
            hdr = await self._reader.readexactly(protocol.HEADER.size)
            reply = await self._reader.readexactly(protocol.header(hdr)[1])
        except asyncio.IncompleteReadError:
            hdr = reply = None
        protocol.check_input_ack(self.pid, hdr, reply)

    async def hang_up(self) -> None:
        """Leave only once the shim has closed its end: a snapshot must find nothing connected."""
        self._writer.write_eof()
        await _drain(self._reader)
        self._writer.close()

    def close(self) -> None:
        self._writer.close()


async def send_input(init_pid: int, pid: int, kind: str, data: bytes = b"", timeout: float | None = None) -> None:
    """control.send_input on asyncio streams: one input frame, acknowledged, then hang up."""
    stream = await InputStream.open(init_pid, pid, timeout)
    try:
        await asyncio.wait_for(stream.send(kind, data), timeout or REPLY_TIMEOUT)
        await asyncio.wait_for(stream.hang_up(), REPLY_TIMEOUT)
    except TimeoutError:
        raise protocol.input_timed_out(pid) from None
    finally:
        stream.close()
