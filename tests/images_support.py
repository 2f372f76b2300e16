"""A real Docker engine and a real registry for the image tests, all on this machine.

dockerd runs with its own data root, exec root and socket under a temporary directory, with
no bridge and no iptables or forwarding rules (nothing the leak census or the host sees), and
is stopped afterwards. Its images are built here: a base imported from the Debian rootfs
set-up caches (debootstrap), and small images built on it with the classic builder and no
network (packages come in as .deb files fetched from the Debian archive on the host).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bunshinfork.fs import rootfs

DOCKER = "/usr/bin/docker"  # Debian's docker.io client
BASE = "bunshin-test/base:1"
APP = "bunshin-test/app:1"
SWE = "bunshin-test/swe:1"
DEEP = "bunshin-test/deep:1"
DEEP_LAYERS = 40
DEBS = rootfs.CACHE / "test-debs"  # sudo and libcap2-bin, downloaded once
START_DEADLINE = 60.0

APP_DOCKERFILE = f"""FROM {BASE}
COPY debs/ /tmp/debs/
RUN dpkg -i /tmp/debs/*.deb && rm -rf /tmp/debs
RUN useradd -m -s /bin/bash user && echo 'user ALL=(ALL) NOPASSWD:ALL' > /etc/sudoers.d/user \\
 && cp /bin/sleep /usr/local/bin/rawping && setcap cap_net_raw+ep /usr/local/bin/rawping \\
 && mkdir -p /opt/keep /srv/opq && touch /opt/keep/a /opt/drop /srv/opq/old
RUN rm /opt/drop /etc/debian_version && rm -rf /srv/opq && mkdir /srv/opq && touch /srv/opq/new
ENV GREETING=hello PATH=/opt/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
WORKDIR /work
USER user
EXPOSE 8080
ENTRYPOINT ["python3", "-m", "http.server", "--bind", "127.0.0.1"]
CMD ["8080"]
"""

SWE_DOCKERFILE = f"""FROM {BASE}
COPY repo/ /repo/
WORKDIR /repo
"""
CALC = "def add(a, b):\n    return a - b\n"
TEST_CALC = """import unittest

from calc import add


class T(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add(2, 3), 5)


if __name__ == "__main__":
    unittest.main()
"""


@dataclass
class Engine:
    host: str  # DOCKER_HOST
    root: Path

    def env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_HOST": self.host, "DOCKER_BUILDKIT": "0"}

    def docker(self, *args: str, input: bytes | None = None, timeout: float = 300) -> str:
        proc = subprocess.run([DOCKER, *args], input=input, capture_output=True, env=self.env(), timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)} failed: {proc.stderr.decode()[-2000:]}")
        return proc.stdout.decode()

    def build(self, tag: str, dockerfile: str, files: dict[str, bytes] | None = None,
              dirs: dict[str, Path] | None = None) -> None:
        ctx = self.root / "ctx" / tag.replace("/", "_").replace(":", "_")
        ctx.mkdir(parents=True)
        (ctx / "Dockerfile").write_text(dockerfile)
        for name, data in (files or {}).items():
            (ctx / name).parent.mkdir(parents=True, exist_ok=True)
            (ctx / name).write_bytes(data)
        for name, src in (dirs or {}).items():
            subprocess.run(["cp", "-a", str(src), str(ctx / name)], check=True, timeout=60)
        self.docker("build", "-q", "--network", "none", "-t", tag, str(ctx), timeout=600)


def _wait(check, what: str, deadline: float = START_DEADLINE) -> None:
    end = time.monotonic() + deadline
    while True:
        with contextlib.suppress(Exception):
            if check():
                return
        if time.monotonic() > end:
            raise RuntimeError(f"{what} did not come up within {deadline:.0f}s")
        time.sleep(0.1)


def _debs() -> Path:
    if not any(DEBS.glob("sudo_*.deb")) or not any(DEBS.glob("libcap2-bin_*.deb")):
        DEBS.mkdir(parents=True, exist_ok=True)
        subprocess.run(["apt-get", "download", "sudo", "libcap2-bin"], cwd=DEBS, check=True,
                       capture_output=True, timeout=300)
    return DEBS


@contextlib.contextmanager
def dockerd(root: Path) -> Iterator[Engine]:
    root.mkdir(parents=True, exist_ok=True)
    sock = root / "docker.sock"
    (root / "daemon.json").write_text("{}")
    log = open(root / "dockerd.log", "wb")  # noqa: SIM115 (the daemon writes it until it stops)
    proc = subprocess.Popen(
        ["dockerd", "--data-root", str(root / "data"), "--exec-root", str(root / "exec"), "-H", f"unix://{sock}",
         "--pidfile", str(root / "docker.pid"), "--bridge=none", "--iptables=false", "--ip6tables=false",
         "--ip-forward=false", "--ip-masq=false", "--userland-proxy=false", "--config-file", str(root / "daemon.json")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    engine = Engine(f"unix://{sock}", root)
    try:
        _wait(lambda: proc.poll() is None and subprocess.run(
            [DOCKER, "version"], env=engine.env(), capture_output=True, timeout=10).returncode == 0, "dockerd")
        yield engine
    finally:
        with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired, RuntimeError):
            ids = engine.docker("ps", "-aq", timeout=30).split()
            if ids:
                engine.docker("rm", "-f", *ids, timeout=60)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()
        subprocess.run(["rm", "-rf", "--one-file-system", str(root / "data"), str(root / "exec")], timeout=120)


def build_base(engine: Engine) -> None:
    """BASE: `docker import` of the Debian rootfs set-up caches."""
    base = rootfs.debian().lowerdirs[0]
    tar = subprocess.run(["tar", "-C", base, "--numeric-owner", "--xattrs", "--exclude=./.bunshin-complete",
                          "-c", "."], capture_output=True, check=True, timeout=300).stdout
    engine.docker("import", "-", BASE, input=tar, timeout=300)


def build_images(engine: Engine) -> None:
    build_base(engine)
    engine.build(APP, APP_DOCKERFILE, dirs={"debs": _debs()})
    engine.build(SWE, SWE_DOCKERFILE, files={"repo/calc.py": CALC.encode(), "repo/test_calc.py": TEST_CALC.encode()})
    lines = [f"FROM {BASE}"] + [f"COPY f{i} /layers/{i}" for i in range(1, DEEP_LAYERS)]
    engine.build(DEEP, "\n".join(lines) + "\n", files={f"f{i}": f"{i}\n".encode() for i in range(1, DEEP_LAYERS)})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def registry(root: Path) -> Iterator[str]:
    """Debian's docker-registry on 127.0.0.1; yields its host:port."""
    port = free_port()
    cfg = root / "registry.yml"
    cfg.write_text(
        "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n"
        f"    rootdirectory: {root / 'registry'}\nhttp:\n  addr: 127.0.0.1:{port}\n"
    )
    log = open(root / "registry.log", "wb")  # noqa: SIM115 (the registry writes it until it stops)
    proc = subprocess.Popen(["docker-registry", "serve", str(cfg)], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        _wait(lambda: proc.poll() is None and urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=2)
              .status == 200, "docker-registry")
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


def skopeo(*args: str, engine: Engine | None = None, timeout: float = 300) -> None:
    extra = []
    if engine is not None and any(a.startswith("docker-daemon:") for a in args):
        extra = ["--src-daemon-host", engine.host]
    proc = subprocess.run(["skopeo", "copy", "--quiet", *extra, *args], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"skopeo copy {' '.join(args)} failed: {proc.stderr[-2000:]}")
