"""The egress proxy for domain rules: reads the HTTP Host header or the TLS SNI of a
workspace's connection, never decrypting, and lets it through only to an allowed name.

One process per workspace that has domain rules (proxies.py starts it). The host's nftables
redirect the workspace's new TCP connections to ports 80 and 443 of denied addresses to this
process's listening socket, which the starter made and hands over (--fd). For each one:

1. the original destination (SO_ORIGINAL_DST); a connection made to the listener itself,
   not redirected, is refused;
2. the first bytes, with a deadline on the whole read: a TLS ClientHello (its server_name), or
   an HTTP/1.x request head (its single Host header);
3. the name must match an allowed domain; it is resolved by the host (getaddrinfo, or the
   DNS server of --resolver), never by the workspace, and the connection goes to the original
   destination if that is one of the name's addresses, else to the name's first address: a
   lying Host or SNI reaches only the allowed name's own servers. An address of this host
   (loopback, the gateway) is refused, so a name cannot open the host's services;
4. the bytes read are replayed to that server and both directions are relayed until either
   side ends or the connection has been idle for IDLE seconds.

Anything else (no name, another name, a failed resolve or connect, a deadline) resets the
workspace's connection at once (RST): never a timeout on the client's side.

Standard library only and no package imports: it runs as `python -I sniproxy.py`, light and
apart from the SDK. policy.py imports its name matching so both agree.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import os
import re
import secrets
import socket
import struct
import sys
import time

TAG = "bunshin-egress-proxy"  # in every proxy's argv: how gc and the census find them
SO_ORIGINAL_DST = 80
PEEK_DEADLINE = 10.0  # for the whole request head or ClientHello
RESOLVE_DEADLINE = 5.0
CONNECT_DEADLINE = 10.0
IDLE = 900.0  # a relayed connection quiet both ways this long is closed
MAX_HEAD = 16384  # an HTTP request head larger than this has no Host we will read
MAX_HELLO = 65536
_LABEL = re.compile(r"^[a-z0-9]([a-z0-9_-]{0,61}[a-z0-9])?$")
_REQUEST_LINE = re.compile(rb"^[A-Z]{1,20} \S+ HTTP/1\.[01]$")


# ---- names ----

def is_hostname(name: str) -> bool:
    """A DNS name of letter-digit-hyphen labels whose last label is not all digits (no IP)."""
    if not name or len(name) > 253:
        return False
    labels = name.split(".")
    return all(_LABEL.match(la) for la in labels) and not labels[-1].isdigit()


def normal_name(raw: str) -> str | None:
    name = raw.strip().lower()
    name = name[:-1] if name.endswith(".") else name
    return name if is_hostname(name) else None


def name_matches(raw: str, domains: tuple[str, ...] | list[str]) -> bool:
    """Whether a Host/SNI name is allowed: equal to a rule, or under a "*.suffix" rule at any
    depth (the apex itself is not)."""
    name = normal_name(raw)
    if name is None:
        return False
    for d in domains:
        if d.startswith("*."):
            if name.endswith(d[1:]):
                return True
        elif name == d:
            return True
    return False


# ---- the first bytes ----

class NeedMore(Exception):
    """The bytes so far are a prefix of something that may still name a host."""


def http_host(data: bytes) -> str | None:
    """The Host of an HTTP/1.x request head; None when it has none, several, or is not HTTP/1."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        if len(data) >= MAX_HEAD:
            return None
        if data and not data[:20].split(b" ", 1)[0].isalpha():
            return None  # not a request line: waiting brings nothing
        raise NeedMore
    lines = data[:end].split(b"\r\n")
    if not _REQUEST_LINE.match(lines[0]):
        return None  # HTTP/2's preface ("PRI * HTTP/2.0") included: its authority is compressed
    fields = [ln.partition(b":") for ln in lines[1:]]
    if any(not colon for _, colon, _ in fields):
        return None  # a header line without a colon: not a request we can trust to parse
    hosts = [value.strip() for key, _, value in fields if key.strip().lower() == b"host"]
    if len(hosts) != 1:
        return None
    try:
        host = hosts[0].decode("ascii")
    except UnicodeDecodeError:
        return None
    if host.startswith("["):
        return None  # an IPv6 literal
    host = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    return host or None


def _handshake(data: bytes) -> bytes:
    """The handshake bytes of the TLS records at the start of `data` (a ClientHello may span
    records); NeedMore until the first handshake message is complete."""
    out = b""
    pos = 0
    while True:
        if len(data) < pos + 5:
            raise NeedMore
        ctype, _major, _minor, length = struct.unpack_from("!BBBH", data, pos)
        if ctype != 22 or length == 0 or length > 16384:
            raise ValueError("not a TLS handshake record")
        if len(data) < pos + 5 + length:
            raise NeedMore
        out += data[pos + 5:pos + 5 + length]
        pos += 5 + length
        if len(out) >= 4 and len(out) >= 4 + int.from_bytes(out[1:4], "big"):
            return out
        if pos >= MAX_HELLO:
            raise ValueError("ClientHello too long")


def tls_sni(data: bytes) -> str | None:
    """The server_name (host_name) of a TLS ClientHello; None when it has none or is malformed."""
    try:
        hs = _handshake(data)
        if hs[0] != 1:
            return None  # not a ClientHello
        body = hs[4:4 + int.from_bytes(hs[1:4], "big")]
        p = 2 + 32  # version, random
        p += 1 + body[p]  # session id
        p += 2 + int.from_bytes(body[p:p + 2], "big")  # cipher suites
        p += 1 + body[p]  # compression methods
        end = p + 2 + int.from_bytes(body[p:p + 2], "big")
        p += 2
        if end > len(body):
            return None
        while p + 4 <= end:
            ext, size = struct.unpack_from("!HH", body, p)
            p += 4
            if ext == 0:  # server_name
                lst = body[p:p + size]
                q = 2
                while q + 3 <= len(lst):
                    kind, n = lst[q], int.from_bytes(lst[q + 1:q + 3], "big")
                    if kind == 0:
                        raw = lst[q + 3:q + 3 + n]
                        return raw.decode("ascii") if len(raw) == n and raw.isascii() else None
                    q += 3 + n
                return None
            p += size
    except (IndexError, ValueError, struct.error):
        return None
    return None


def requested_name(data: bytes) -> str | None:
    """The name the first bytes ask for, TLS or HTTP; NeedMore while undecided."""
    if not data:
        raise NeedMore
    if data[0] == 22:
        try:
            _handshake(data)
        except ValueError:
            return None
        return tls_sni(data)
    return http_host(data)


# ---- resolving, on the host's side ----

def _dns_query(name: str, server: str) -> list[str]:
    """A records of `name` from `server`, over UDP (a plain recursive query)."""
    qid = secrets.randbelow(65536)
    q = struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0)
    q += b"".join(bytes([len(la)]) + la.encode() for la in name.split(".")) + b"\0" + struct.pack("!HH", 1, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(RESOLVE_DEADLINE)
        s.connect((server, 53))
        s.send(q)
        while True:
            r = s.recv(4096)
            if len(r) >= 12 and struct.unpack_from("!H", r)[0] == qid:
                break
    _, flags, qd, an, _, _ = struct.unpack_from("!HHHHHH", r)
    if flags & 0x000F:
        return []

    def skip_name(p: int) -> int:
        while r[p]:
            if r[p] & 0xC0 == 0xC0:
                return p + 2
            p += 1 + r[p]
        return p + 1

    p = 12
    for _ in range(qd):
        p = skip_name(p) + 4
    out = []
    for _ in range(an):
        p = skip_name(p)
        rtype, _cls, _ttl, size = struct.unpack_from("!HHIH", r, p)
        p += 10
        if rtype == 1 and size == 4:
            out.append(socket.inet_ntoa(r[p:p + 4]))
        p += size
    return out


async def resolve(name: str, resolver: str | None) -> list[str]:
    if resolver:
        return await asyncio.wait_for(asyncio.to_thread(_dns_query, name, resolver), RESOLVE_DEADLINE + 1)
    infos = await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo(
        name, None, family=socket.AF_INET, type=socket.SOCK_STREAM), RESOLVE_DEADLINE)
    return list(dict.fromkeys(str(i[4][0]) for i in infos))


def _is_local(addr: str) -> bool:
    """An address of this host (or one no server should be reached at through the proxy)."""
    ip = ipaddress.IPv4Address(addr)
    if ip.is_loopback or ip.is_unspecified or ip.is_multicast or ip.is_link_local:
        return True
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr, 0))  # succeeds only for a local address
        except OSError:
            return False
    return True


# ---- the proxy ----

def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def original_dst(sock: socket.socket) -> tuple[str, int]:
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, addr = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(addr), port


async def _peek(reader: asyncio.StreamReader) -> tuple[bytes, str | None]:
    data = b""
    async with asyncio.timeout(PEEK_DEADLINE):
        while True:
            chunk = await reader.read(MAX_HELLO)
            if not chunk:
                return data, None
            data += chunk
            try:
                return data, requested_name(data)
            except NeedMore:
                continue


class _Idle:
    def __init__(self) -> None:
        self.last = time.monotonic()


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, idle: _Idle) -> None:
    while True:
        try:
            left = IDLE - (time.monotonic() - idle.last)
            data = await asyncio.wait_for(src.read(65536), max(left, 0.001))
        except TimeoutError:
            if time.monotonic() - idle.last < IDLE:
                continue  # the other direction was busy meanwhile
            raise
        if not data:
            if dst.can_write_eof():
                dst.write_eof()
            return
        idle.last = time.monotonic()
        dst.write(data)
        await dst.drain()


class Proxy:
    def __init__(self, domains: list[str], resolver: str | None) -> None:
        self.domains, self.resolver = domains, resolver

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream: asyncio.StreamWriter | None = None
        try:
            sock = writer.get_extra_info("socket")
            dst, port = original_dst(sock)
            if (dst, port) == sock.getsockname()[:2]:
                raise ConnectionRefusedError("not redirected")
            data, name = await _peek(reader)
            if name is None or not name_matches(name, self.domains):
                raise ConnectionRefusedError(f"{name!r} is not allowed")
            addrs = await resolve(name.lower().rstrip("."), self.resolver)
            target = dst if dst in addrs else (addrs[0] if addrs else None)
            if target is None or _is_local(target):
                raise ConnectionRefusedError(f"{name!r} has no address to reach")
            up_reader, upstream = await asyncio.wait_for(asyncio.open_connection(target, port), CONNECT_DEADLINE)
            upstream.write(data)
            await upstream.drain()
            idle = _Idle()
            pipes = [asyncio.create_task(_pipe(reader, upstream, idle)),
                     asyncio.create_task(_pipe(up_reader, writer, idle))]
            done, pending = await asyncio.wait(pipes, return_when=asyncio.FIRST_EXCEPTION)
            for t in pending:
                t.cancel()
            for t in done:
                t.result()  # a reset or the idle deadline: both ends are reset below
            writer.close()
            upstream.close()
        except Exception:  # whatever went wrong, the client gets a reset, never a hang
            _reset(writer)
            if upstream is not None:
                _reset(upstream)


async def serve(fd: int, domains: list[str], resolver: str | None) -> None:
    sock = socket.socket(fileno=fd)
    sock.setblocking(False)
    server = await asyncio.start_server(Proxy(domains, resolver).handle, sock=sock)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tag", required=True)
    ap.add_argument("--ws", required=True)
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--domains", required=True)
    ap.add_argument("--resolver")
    args = ap.parse_args(argv)
    os.set_inheritable(args.fd, False)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.fd, [d for d in args.domains.split(",") if d], args.resolver))


if __name__ == "__main__":
    sys.exit(main())
