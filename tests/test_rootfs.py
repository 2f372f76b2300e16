"""Root file systems: the default "host" rootfs must expose the host's programs but none of its
data; directory, Debian and Docker sources work or fail with a typed error."""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import run_ok

from bunshinfork import state
from bunshinfork.errors import RootfsError
from bunshinfork.fs import rootfs
from bunshinfork.workspace import Workspace


def _sha256(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# ---- host rootfs: no host data inside ----


def test_host_secrets_are_absent(ws: Workspace) -> None:
    # These exist on the host (checked where present) and must not show through the skeleton.
    secrets_ = ["/etc/shadow", "/etc/gshadow", "/etc/ssh", "/etc/sudoers", "/etc/machine-id"]
    assert os.path.exists("/etc/shadow"), "precondition: the host has /etc/shadow"
    script = "; ".join(f"test -e {p} && echo {p}" for p in secrets_) + "; true"
    assert run_ok(ws, script).stdout == ""
    for p in secrets_:
        assert not ws.files.exists(p)


def test_etc_holds_only_the_generated_and_copied_files(ws: Workspace) -> None:
    inside = set(run_ok(ws, "ls -A /etc").stdout.split())
    allowed = set(rootfs.HOST_ETC_COPY) | set(rootfs._generated_etc()) | {"localtime"}
    assert inside <= allowed, f"host /etc entries leaked: {sorted(inside - allowed)}"
    # The generated identity replaces the host's.
    passwd = run_ok(ws, "cat /etc/passwd").stdout
    assert passwd == rootfs._generated_etc()["passwd"]
    assert passwd != Path("/etc/passwd").read_text()
    assert run_ok(ws, "getent passwd root").stdout.startswith("root:x:0:0:")


def test_root_and_home_are_empty(ws: Workspace) -> None:
    assert os.listdir("/root") or os.listdir("/home"), "precondition: host /root or /home has content"
    assert run_ok(ws, "ls -A /root /home").stdout.split() == ["/home:", "/root:"]


def test_var_has_no_host_content(ws: Workspace) -> None:
    assert os.path.isdir("/var/lib/dpkg") and os.listdir("/var/log"), "precondition: host /var has content"
    found = set(run_ok(ws, "cd / && find var -mindepth 1").stdout.split())
    # Exactly the skeleton's directories, nothing from the host's /var.
    assert found == set(rootfs.VAR_DIRS)
    assert run_ok(ws, "ls -A /var/log").stdout == ""
    assert ws.commands.run("test -e /var/lib/dpkg").exit_code == 1


def test_only_skeleton_and_usr_at_top_level(ws: Workspace) -> None:
    host_top = set(os.listdir("/"))
    assert {"work", "opt"} <= host_top, "precondition: the host has /work and /opt"
    inside = set(run_ok(ws, "ls -A /").stdout.split())
    expected = set(rootfs.SKELETON_DIRS) | {n for n in rootfs.HOST_KEEP if n in host_top} | {".bunshin"}
    assert inside == expected
    hidden = host_top - set(rootfs.HOST_KEEP) - set(rootfs.SKELETON_DIRS)
    assert hidden, "precondition: the host has top-level entries the skeleton hides"
    for name in hidden:
        assert ws.commands.run(["test", "-e", f"/{name}"]).exit_code == 1, f"/{name} is visible"
    # Directories the skeleton keeps must be empty even where the host's are not.
    for name in ("opt", "srv", "mnt", "media", "boot"):
        assert run_ok(ws, f"ls -A /{name}").stdout == "", f"/{name} shows host content"
    # This very test file lives under /work on the host.
    assert ws.commands.run(["test", "-e", __file__]).exit_code == 1


def test_host_programs_run(ws: Workspace) -> None:
    assert run_ok(ws, "echo $BASH_VERSION").stdout.strip()
    # ssl loads the CA bundle through the copied /etc/ssl: a broken skeleton fails here.
    script = "import json, ssl; ssl.create_default_context(); print(json.dumps([1]))"
    r = run_ok(ws, ["python3", "-c", script])
    assert r.stdout == "[1]\n"
    listing = set(run_ok(ws, "ls /usr/bin").stdout.split())
    assert {"bash", "python3", "ls", "env"} <= listing
    assert listing == set(os.listdir("/usr/bin"))


def test_usr_writes_stay_in_the_workspace(ws: Workspace) -> None:
    name = f"bunshin-probe-{secrets.token_hex(4)}"
    target = "/usr/lib/os-release"
    before = _sha256(target)
    run_ok(ws, f"echo probe > /usr/bin/{name} && echo junk >> {target} && rm /usr/bin/env")
    # Inside: every change is visible.
    assert run_ok(ws, f"cat /usr/bin/{name}").stdout == "probe\n"
    assert run_ok(ws, f"tail -n1 {target}").stdout == "junk\n"
    assert ws.commands.run("test -e /usr/bin/env").exit_code == 1
    # Host: untouched.
    assert not os.path.exists(f"/usr/bin/{name}")
    assert _sha256(target) == before
    assert os.path.exists("/usr/bin/env")
    # The writes landed in the workspace's private upper layer.
    upper = Path(ws._rec.fs.layer.path) / "upper"
    assert (upper / "usr/bin" / name).read_text() == "probe\n"


# ---- directory rootfs ----


def _minimal_bash_rootfs(dest: Path) -> None:
    """bash and the shared objects it links, nothing else: enough to prove which root is in use."""
    bash = shutil.which("bash")
    assert bash
    deps = subprocess.run(["ldd", bash], capture_output=True, text=True, check=True).stdout
    libs = [tok for line in deps.splitlines() for tok in line.split() if tok.startswith("/")]
    assert libs, deps
    for src in [bash, *libs]:
        rel = Path(src).relative_to("/")
        if src == bash:
            rel = Path("bin/bash")
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.realpath(src), dest / rel)
    os.symlink("bash", dest / "bin/sh")


def test_directory_rootfs(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _minimal_bash_rootfs(root)
    with Workspace.create(rootfs=str(root)) as ws:
        info = ws.info()
        assert info.rootfs == str(root)
        assert info.rootfs_digest.startswith("dir-")
        top = set(run_ok(ws, "shopt -s dotglob; cd / && echo *").stdout.split())
        assert {"bin", "lib64", ".bunshin"} <= top
        assert "usr" not in top  # the host's /usr is not layered in
        assert ws.commands.run("command -v ls").exit_code == 1
        # The rootfs has no /root; the default cwd must still exist.
        assert run_ok(ws, "pwd").stdout == "/root\n"
        run_ok(ws, "echo written > /bin/new-file")
        assert run_ok(ws, "read -r l < /bin/new-file; echo $l").stdout == "written\n"
    # The directory is a read-only lower layer.
    assert not (root / "bin/new-file").exists()


def test_debootstrap_cache_as_directory_rootfs() -> None:
    cached = rootfs.CACHE / "rootfs" / f"debian-{rootfs.DEBIAN_SUITE}"
    if not (cached / ".bunshin-complete").exists():
        pytest.skip("no debootstrap cache; the slow Debian test builds it")
    with Workspace.create(rootfs=str(cached)) as ws:
        assert ws.info().rootfs_digest.startswith("dir-")
        assert run_ok(ws, "cat /etc/debian_version").stdout.startswith("12")
        assert "_apt" in run_ok(ws, "cat /etc/passwd").stdout


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("relative/rootfs", "absolute path"),
        ("/nonexistent/bunshin-rootfs", "does not exist"),
    ],
)
def test_directory_rootfs_bad_path(source: str, message: str) -> None:
    with pytest.raises(RootfsError, match=message):
        Workspace.create(rootfs=source)


def test_directory_rootfs_without_shell(tmp_path: Path) -> None:
    (tmp_path / "usr/lib").mkdir(parents=True)
    with pytest.raises(RootfsError, match="no /bin/sh"):
        Workspace.create(rootfs=str(tmp_path))


def test_directory_rootfs_on_state_filesystem() -> None:
    # Overlayfs refuses such a layer at mount time with a bare EINVAL; the check must say why first.
    root = state.run_root() / f".test-rootfs-{secrets.token_hex(4)}"
    (root / "bin").mkdir(parents=True)
    try:
        (root / "bin/sh").write_text("")
        with pytest.raises(RootfsError, match="same file system"):
            Workspace.create(rootfs=str(root))
    finally:
        shutil.rmtree(root)


# ---- Docker and Debian ----


def test_docker_rootfs_without_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    # Point the SDK at a socket that cannot exist, whatever this host runs.
    monkeypatch.setenv("DOCKER_HOST", f"unix:///nonexistent/docker-{secrets.token_hex(4)}.sock")
    with pytest.raises(RootfsError, match="Docker engine"):
        Workspace.create(rootfs="docker:alpine")


@pytest.mark.slow
def test_debian_rootfs() -> None:
    # The first build runs debootstrap against the Debian mirror (minutes); later runs use the cache.
    with Workspace.create(rootfs="debian") as ws:
        info = ws.info()
        assert info.rootfs == f"debian:{rootfs.DEBIAN_SUITE}"
        assert info.rootfs_digest.startswith("debian-")
        assert run_ok(ws, "cat /etc/debian_version").stdout.startswith("12")
        assert run_ok(ws, "apt-get --version").stdout.startswith("apt ")
        assert run_ok(ws, ["python3", "-c", "print(6 * 7)"]).stdout == "42\n"
        # Debian's own /etc, not the host skeleton's generated one.
        assert "_apt" in run_ok(ws, "cat /etc/passwd").stdout
