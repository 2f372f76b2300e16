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

    policy = TemplatePolicy(tuple(args.allow_template), args.allow_images, tuple(args.allow_registry))
    key = _key(args.api_key_file)
    # The key is printed only when the server made it: one read from a file stays there (the
    # output goes to terminals, logs and CI transcripts), and the line reads it back.
    shown_key = key if args.api_key_file is None else f'"$(cat {shlex.quote(str(args.api_key_file))})"'
    tls = _tls(args.tls_cert, args.tls_key)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
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

    app = make_app(key, args.state_dir, args.domain, on_ready=ready, public_domain=public_domain, policy=policy)
    # h11, whatever else is installed: it hands the request-target over as sent (httptools would
    # turn an absolute-form target into its path), so the router can refuse what is not a path.
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=10, http="h11",
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
