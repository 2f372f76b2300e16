"""`bunshin serve` with TLS, for clients that set only E2B_DOMAIN (E2B's own way of pointing
the SDKs at a deployment): the real e2b SDK derives https://api.<domain> and
https://49983-<id>.<domain> itself, and get_host's `<port>-<id>.<domain>` reaches a port.

The certificate is the test's own: a CA made here (clients trust it through SSL_CERT_FILE, as
a user trusts a private CA) signs a wildcard certificate for `*.bunshin.localhost`. The domain
has two labels because clients refuse a wildcard that covers a whole top-level name:
OpenSSL, rustls and Node all reject `*.localhost` for `api.localhost`. Every `*.localhost`
name resolves to loopback through glibc's myhostname module (libnss-myhostname, installed by
scripts/setup.sh). The SDK runs in a child process with a clean environment, as a user's
program does: its HTTP pool reads the CA store once per process.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import e2b_server_support as support
import pytest

from bunshinfork import state

pytestmark = pytest.mark.timeout(300)

DOMAIN = "bunshin.localhost"

# The user's program: only E2B_DOMAIN, E2B_API_KEY and SSL_CERT_FILE are set.
CLIENT = r"""
import json, time
import httpx
from e2b import Sandbox

out = {}
sbx = Sandbox.create(timeout=120, allow_internet_access=True)
try:
    out["api_url"] = sbx.connection_config.api_url
    out["envd_url"] = sbx.envd_api_url.replace(sbx.sandbox_id, "ID")
    r = sbx.commands.run('echo "Hello from E2B!"; whoami')
    out["stdout"] = r.stdout
    sbx.files.write("/tmp/www/index.html", "over tls")
    out["read"] = sbx.files.read("/tmp/www/index.html")
    out["download"] = httpx.get(sbx.download_url("/tmp/www/index.html", use_signature_expiration=60),
                                timeout=30).text
    sbx.commands.run("cd /tmp/www && python3 -m http.server 8000", background=True)
    sbx.commands.run("for i in $(seq 200); do python3 -c 'import socket; socket.create_connection("
                     "(\"127.0.0.1\", 8000), 1)' 2>/dev/null && exit 0; sleep 0.05; done; exit 1")
    host = sbx.get_host(8000)
    out["host"] = host.replace(sbx.sandbox_id, "ID")
    out["port"] = httpx.get(f"https://{host}/index.html", timeout=30).text
    (child,) = sbx.fork(count=1)
    if isinstance(child, Exception):
        raise child
    out["fork_envd_url"] = child.envd_api_url == f"https://49983-{child.sandbox_id}.{child.sandbox_domain}"
    out["fork"] = child.commands.run("cat /tmp/www/index.html").stdout
    out["fork_killed"] = child.kill()
    out["killed"] = sbx.kill()
    out["running_after_kill"] = sbx.is_running()
    out["kill_unknown"] = Sandbox.kill(sbx.sandbox_id)
finally:
    Sandbox.kill(sbx.sandbox_id)
print(json.dumps(out))
"""


def _loopback_names() -> str | None:
    """Why the names cannot be used here, or None."""
    for name in (f"api.{DOMAIN}", f"49983-x1.{DOMAIN}"):
        try:
            addrs = {a[4][0] for a in socket.getaddrinfo(name, 443, type=socket.SOCK_STREAM)}
        except socket.gaierror as e:
            return f"{name} does not resolve ({e}): install libnss-myhostname (scripts/setup.sh)"
        if not addrs <= {"127.0.0.1", "::1"}:
            return f"{name} resolves to {addrs}, not loopback"
    return None


def _port_443_free() -> str | None:
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", 443))
    except OSError as e:
        return "127.0.0.1:443 is taken" if e.errno == errno.EADDRINUSE else f"cannot bind 127.0.0.1:443: {e}"
    finally:
        s.close()
    return None


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certs(d: Path) -> tuple[Path, Path, Path]:
    """A CA, and a certificate it signs for DOMAIN and *.DOMAIN: (ca, cert, key)."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=bunshin test CA", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "key.pem", "-out", "req.csr",
             "-subj", f"/CN={DOMAIN}", cwd=d)
    (d / "ext.cnf").write_text(f"subjectAltName=DNS:{DOMAIN},DNS:*.{DOMAIN}\n"
                               "basicConstraints=critical,CA:FALSE\nextendedKeyUsage=serverAuth\n"
                               "keyUsage=critical,digitalSignature,keyEncipherment\n")
    _openssl("x509", "-req", "-in", "req.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "cert.pem", "-days", "2", "-extfile", "ext.cnf", cwd=d)
    return d / "ca.pem", d / "cert.pem", d / "key.pem"


@pytest.fixture(scope="module")
def tls_dir() -> Iterator[tuple[Path, Path, Path, Path]]:
    """(directory, ca, cert, key); the directory, with the CA's key and the servers' state in it,
    is removed at the end."""
    for why in (None if shutil.which("openssl") else "no openssl", _loopback_names()):
        if why is not None:
            pytest.skip(why)
    with tempfile.TemporaryDirectory(prefix="bunshin-tls-") as tmp:
        d = Path(tmp)
        (d / "certs").mkdir()
        ca, cert, key = make_certs(d / "certs")
        (d / "api-key").write_text("tls-key-" + os.urandom(8).hex())
        yield d, ca, cert, key


@contextlib.contextmanager
def serving(tls: tuple[Path, Path, Path, Path], port: int, name: str) -> Iterator[support.Served]:
    d, _, cert, key = tls
    served = support.start(d / name, d / "api-key", port=port,
                           extra=("--tls-cert", str(cert), "--tls-key", str(key), "--domain", DOMAIN))
    try:
        yield served
    finally:
        assert served.stop() == 0, "".join(served.log)
        left = [i for i in state.all_ids() if state.Record.load(i).creator_pid == served.proc.pid]
        assert not left, f"the server left workspaces behind: {left}"


@pytest.fixture(scope="module")
def tls_served(tls_dir: tuple[Path, Path, Path, Path]) -> Iterator[tuple[support.Served, Path]]:
    """The server as E2B's clients expect it: https on port 443."""
    why = _port_443_free()
    if why is not None:
        pytest.skip(why)
    with serving(tls_dir, 443, "state-443") as served:
        yield served, tls_dir[1]


def _client_env(served: support.Served, ca: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    return {**env, **served.env, "SSL_CERT_FILE": str(ca)}


def test_exports_only_the_domain(tls_served: tuple[support.Served, Path]) -> None:
    served, _ = tls_served
    assert served.env == {"E2B_DOMAIN": DOMAIN, "E2B_API_KEY": served.key}


def test_python_sdk_with_only_e2b_domain(tls_served: tuple[support.Served, Path]) -> None:
    served, ca = tls_served
    run = subprocess.run([sys.executable, "-c", CLIENT], env=_client_env(served, ca), capture_output=True,
                         text=True, timeout=240)
    assert run.returncode == 0, run.stderr + "".join(served.log)
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out == {
        "api_url": f"https://api.{DOMAIN}", "envd_url": f"https://49983-ID.{DOMAIN}",
        "stdout": "Hello from E2B!\nuser\n", "read": "over tls", "download": "over tls",
        "host": f"8000-ID.{DOMAIN}", "port": "over tls",
        "fork_envd_url": True, "fork": "over tls", "fork_killed": True,
        "killed": True, "running_after_kill": False, "kill_unknown": False,
    }


def test_wrong_key_and_plain_http_are_refused(tls_served: tuple[support.Served, Path]) -> None:
    """The control plane at api.<domain> still needs the key; port 443 speaks only TLS."""
    import ssl

    import httpx

    served, ca = tls_served
    with httpx.Client(verify=ssl.create_default_context(cafile=str(ca)), timeout=30) as c:
        r = c.get(f"https://api.{DOMAIN}/v2/sandboxes", headers={"X-API-KEY": "wrong"})
        assert r.status_code == 401 and r.json() == {"code": 401, "message": "Invalid API key"}
        assert c.get(f"https://api.{DOMAIN}/v2/sandboxes", headers={"X-API-KEY": served.key}).status_code == 200
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://api.{DOMAIN}:443/v2/sandboxes", headers={"X-API-KEY": served.key}, timeout=10)


SHORT_CLIENT = r"""
import json
from e2b import Sandbox

with Sandbox.create(timeout=60) as sbx:
    out = {"api_url": sbx.connection_config.api_url, "envd_url": sbx.envd_api_url.replace(sbx.sandbox_id, "ID"),
           "stdout": sbx.commands.run("echo on another port").stdout}
out["running"] = sbx.is_running()
print(json.dumps(out))
"""


def test_another_port_travels_in_the_domain(tls_dir: tuple[Path, Path, Path, Path]) -> None:
    """Off port 443 the server exports E2B_DOMAIN=<domain>:<port>, and the SDK's URLs carry it."""
    with serving(tls_dir, 0, "state-any") as served:
        assert served.domain is not None and served.domain.startswith(f"{DOMAIN}:")
        run = subprocess.run([sys.executable, "-c", SHORT_CLIENT], env=_client_env(served, tls_dir[1]),
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr + "".join(served.log)
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {
        "api_url": f"https://api.{served.domain}", "envd_url": f"https://49983-ID.{served.domain}",
        "stdout": "on another port\n", "running": False}


