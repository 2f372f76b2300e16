"""`bunshin serve`: E2B's API over HTTP for the unmodified e2b SDKs (see bunshinfork.serve)."""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shlex
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .common import Verb

DEFAULT_ROOT = Path(os.environ.get("BUNSHIN_SERVE_ROOT", "/var/lib/bunshin/serve"))
MAX_CONNECTIONS = 1024


class DEFAULTS:
    """serve.limits.Limits()'s defaults, here so that building the CLI imports no server (a test
    checks they agree)."""

    max_sandboxes = 100
    memory_mb = 512
    pids = 1024
    cpu_count = 2
    disk_mb = 10240
    max_upload_bytes = 256 << 20
    header_timeout = 10.0

# An idle connection between requests is closed after this long. Above the clients' own idle
# expiry (httpx 5 s, Node's 4-5 s, aiohttp 15 s), so that they drop a connection before the server
# does; at uvicorn's 5 s, a client that waited 5 s (E2B's tests sleep 5 s for a timeout to pass)
# could send its request just as the server closed the connection: "connection closed before
# message completed". A client that keeps connections longer (hyper: 90 s) meets that only at 30 s.
KEEP_ALIVE_S = 30.0
MAX_HEAD_BYTES = 64 * 1024  # a request's head (line and headers) at most: h11 answers 431 past it


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text}")
    return value


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: loopback only)")
    p.add_argument("--port", type=int, help="port (default 3000, or 443 with --tls-cert; 0: any free port)")
    p.add_argument("--api-key-file", type=Path,
                   help="file holding the API key clients send as X-API-KEY (default: a new random key, "
                        "printed; a key from this file is not printed)")
    p.add_argument("--domain", default="localhost",
                   help="the domain of get_host's `<port>-<id>.<domain>` names (default localhost)")
    p.add_argument("--tls-cert", type=Path,
                   help="serve HTTPS with this certificate (PEM chain), for clients that set only E2B_DOMAIN: "
                        "it must name *.<domain>, and the names must resolve to this server")
    p.add_argument("--tls-key", type=Path, help="the private key of --tls-cert (PEM)")
    p.add_argument("--allow-template", action="append", default=[], metavar="TEMPLATE",
                   help="offer this template too (repeatable): an image reference, exactly or with '*' for "
                        "docker:/registry: (docker:python:*, registry:ghcr.io/acme/*), or exactly an oci:DIR "
                        "or a directory. base, debian, this server's snapshots and warm templates are always "
                        "offered, nothing else unless named")
    p.add_argument("--allow-images", action="store_true",
                   help="offer any docker:IMAGE and any registry:REF of a public registry (not loopback, "
                        "private or link-local)")
    p.add_argument("--allow-registry", action="append", default=[], metavar="HOST[:PORT]",
                   help="offer any registry:REF from this registry, loopback or private ones too (repeatable)")
    limits = DEFAULTS
    p.add_argument("--max-sandboxes", type=_positive, default=limits.max_sandboxes, metavar="N",
                   help=f"running sandboxes at once, forks included (default {limits.max_sandboxes}); past it "
                        "creates and forks are answered 429")
    p.add_argument("--sandbox-memory-mb", type=_positive, default=limits.memory_mb, metavar="MB",
                   help=f"each sandbox's memory limit (default {limits.memory_mb}, E2B's base template's)")
    p.add_argument("--sandbox-pids", type=_positive, default=limits.pids, metavar="N",
                   help=f"each sandbox's process and thread limit (default {limits.pids})")
    p.add_argument("--sandbox-cpus", type=_positive, default=limits.cpu_count, metavar="N",
                   help=f"each sandbox's CPU time, in cores (default {limits.cpu_count}, E2B's base template's)")
    p.add_argument("--sandbox-disk-mb", type=_positive, default=limits.disk_mb, metavar="MB",
                   help=f"what each sandbox may write (default {limits.disk_mb}): its layer, /tmp and /dev/shm each")
    p.add_argument("--template-limits", nargs=2, action="append", default=[], metavar=("TEMPLATE", "LIMITS"),
                   help="other limits for sandboxes started from TEMPLATE (exactly, or a '*' pattern), as "
                        "cpu=N,memory-mb=N,disk-mb=N,pids=N, any of them (repeatable; the first match wins)")
    p.add_argument("--no-userns", dest="userns", action="store_false",
                   help="run sandboxes without a user namespace (root inside is the host's root, held by "
                        "capabilities, seccomp and masks alone); by default each runs in one (docs/security.md)")
    p.add_argument("--max-upload-bytes", type=_positive, default=limits.max_upload_bytes, metavar="BYTES",
                   help=f"the largest /files upload or envd request body (default {limits.max_upload_bytes}, "
                        "256 MiB); control-plane bodies are held to 1 MiB")
    p.add_argument("--block-private", action="store_true",
                   help="sandboxes reach no private address (10/8, 172.16/12, 192.168/16, 100.64/10); "
                        "169.254/16, the host's services and the other sandboxes are refused always")
    p.add_argument("--header-timeout", type=float, default=limits.header_timeout, metavar="SECONDS",
                   help=f"close a connection that has not sent a request's headers within this time "
                        f"(default {limits.header_timeout:g})")
    p.add_argument("--timeout-keep-alive", type=_seconds, default=KEEP_ALIVE_S, metavar="SECONDS",
                   help=f"close a connection idle between requests after this time (default {KEEP_ALIVE_S:g})")
    p.add_argument("--max-connections", type=_positive, default=MAX_CONNECTIONS, metavar="N",
                   help=f"connections served at once; past it, 503 (default {MAX_CONNECTIONS})")
    p.add_argument("--state-dir", type=Path, default=DEFAULT_ROOT,
                   help=f"where paused sandboxes and the registry are kept (default {DEFAULT_ROOT})")


def _key(path: Path | None) -> str:
    if path is None:
        return "e2b_" + secrets.token_hex(20)
    from ..errors import InvalidArgumentException

    try:
        key = path.read_text().strip()
    except OSError as e:
        raise InvalidArgumentException(f"cannot read the API key file {path}: {e.strerror}") from None
    if not key or any(c.isspace() for c in key):
        raise InvalidArgumentException(f"the API key file {path} must hold one key (no spaces)")
    return key


def _tls(cert: Path | None, key: Path | None) -> tuple[str, str] | None:
    """The certificate and key files, checked before anything binds (uvicorn would fail later)."""
    from ..errors import InvalidArgumentException

    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise InvalidArgumentException("--tls-cert and --tls-key go together")
    import ssl

    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise InvalidArgumentException(f"cannot use the certificate {cert} with the key {key}: {e}") from None
    return str(cert), str(key)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ..serve import make_app
    from ..serve.allow import TemplatePolicy
    from ..serve.limits import Limits, header_timeout_protocol
    from ..serve.resources import parse_override

    policy = TemplatePolicy(tuple(args.allow_template), args.allow_images, tuple(args.allow_registry))
    key = _key(args.api_key_file)
    # The key is printed only when the server made it: one read from a file stays there (the
    # output goes to terminals, logs and CI transcripts), and the line reads it back.
    shown_key = key if args.api_key_file is None else f'"$(cat {shlex.quote(str(args.api_key_file))})"'
    tls = _tls(args.tls_cert, args.tls_key)
    # IPPROTO_TCP named, not left 0: asyncio turns Nagle's algorithm off only on a connection whose
    # socket says it is TCP (base_events._set_nodelay), and an accepted socket takes the listener's.
    # With it on, every response after a connection's first waited for the client's delayed ACK
    # between its head and its body: 40 ms on each call an SDK makes over its kept-alive pool.
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM,
                         socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port if args.port is not None else 443 if tls else 3000))
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}"
    # With TLS the SDKs derive every URL from E2B_DOMAIN (https://api.<domain>,
    # https://49983-<id>.<domain>): a port other than 443 travels inside the domain.
    public_domain = args.domain if not tls or port == 443 else f"{args.domain}:{port}"
    # Listening from here on: clients that connect before the application is ready wait in the backlog.
    sock.listen(2048)

    def ready() -> None:
        # Printed once the server has taken over what a previous one left: then it is usable.
        where = f"export E2B_DOMAIN={public_domain}" if tls else \
            f"export E2B_API_URL={url}\nexport E2B_SANDBOX_URL={url}"
        print(f"{where}\nexport E2B_API_KEY={shown_key}", flush=True)

    limits = Limits(max_sandboxes=args.max_sandboxes, memory_mb=args.sandbox_memory_mb, pids=args.sandbox_pids,
                    cpu_count=args.sandbox_cpus, disk_mb=args.sandbox_disk_mb,
                    max_upload_bytes=args.max_upload_bytes, block_private=args.block_private,
                    header_timeout=args.header_timeout, userns=args.userns,
                    template_limits=tuple(parse_override(t, spec) for t, spec in args.template_limits))
    app = make_app(key, args.state_dir, args.domain, on_ready=ready, public_domain=public_domain, policy=policy,
                   limits=limits)
    # h11, whatever else is installed: it hands the request-target over as sent (httptools would
    # turn an absolute-form target into its path), so the router can refuse what is not a path;
    # with a deadline on each request's head, which uvicorn lacks.
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=10,
                            http=header_timeout_protocol(limits.header_timeout),
                            timeout_keep_alive=args.timeout_keep_alive, limit_concurrency=args.max_connections,
                            h11_max_incomplete_event_size=MAX_HEAD_BYTES,
                            ssl_certfile=tls[0] if tls else None, ssl_keyfile=tls[1] if tls else None)
    _server(config).run(sockets=[sock])
    sys.stdout.flush()
    return 0


def _server(config: Any) -> Any:
    """uvicorn's server, ending with status 0 after a SIGTERM or SIGINT: uvicorn re-raises the
    signal once shut down, which would skip the interpreter's exit handlers (bunshin's leave the
    host's ksmd boost there)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            saved = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in saved.items():
                    signal.signal(sig, handler)

    return Server(config)


VERB = Verb("serve", "serve E2B's API over HTTP for the e2b SDKs; prints the variables to export", configure, run)
