"""Image layers unpacked by hand (bunshinfork.images.unpack) and image references: what a
layer keeps, and what untrusted tars and references cannot do (Hypothesis)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bunshinfork.errors import CorruptLayer, ImageReferenceError, UnsafeLayerEntry
from bunshinfork.images import reference, unpack

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
CAP_NET_RAW = bytes([1, 0, 0, 2, 0, 0x20, 0, 0] + [0] * 12)  # v2, permitted+effective: cap_net_raw


def _tar(*entries: tuple[str, str, dict]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, kind, kw in entries:
            ti = tarfile.TarInfo(name)
            ti.type = {"file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "sym": tarfile.SYMTYPE,
                       "hard": tarfile.LNKTYPE, "chr": tarfile.CHRTYPE, "fifo": tarfile.FIFOTYPE}[kind]
            data = kw.pop("data", b"")
            for k, v in kw.items():
                setattr(ti, k, v)
            ti.size = len(data) if kind == "file" else 0
            tf.addfile(ti, io.BytesIO(data) if kind == "file" else None)
    return buf.getvalue()


def test_layer_keeps_modes_owners_xattrs_links_fifos_and_whiteouts(tmp_path: Path) -> None:
    raw = _tar(
        ("usr/bin/sudo", "file", {"data": b"s", "mode": 0o4755}),
        ("usr/bin/wall", "file", {"data": b"w", "mode": 0o2755, "gid": 5}),
        ("tmp", "dir", {"mode": 0o1777}),
        ("usr/bin/ping", "file", {"data": b"p", "mode": 0o755,
                                  "pax_headers": {"SCHILY.xattr.security.capability": CAP_NET_RAW.decode(
                                      "utf-8", "surrogateescape")}}),
        ("usr/bin/sudoedit", "hard", {"linkname": "usr/bin/sudo"}),
        ("bin", "sym", {"linkname": "usr/bin"}),
        ("etc/alt", "sym", {"linkname": "/etc/alternatives/x"}),
        ("dev/null", "chr", {"devmajor": 1, "devminor": 3, "mode": 0o666}),
        ("run/fifo", "fifo", {"mode": 0o644}),
        ("home/user/f", "file", {"data": b"u", "uid": 1000, "gid": 1000, "mode": 0o640}),
        ("etc/.wh.motd", "file", {}),
        ("srv/.wh..wh..opq", "file", {}),
        ("x/.wh..wh.plnk", "file", {}),
    )
    out = unpack.unpack(io.BytesIO(raw), tmp_path)
    assert out.diff_id == "sha256:" + hashlib.sha256(raw).hexdigest()
    assert len(out.skipped) == 1 and out.skipped[0].startswith("dev/null: a device node")  # images carry none
    mode = lambda p: stat.S_IMODE(os.lstat(tmp_path / p).st_mode)  # noqa: E731
    assert (mode("usr/bin/sudo"), mode("usr/bin/wall"), mode("tmp")) == (0o4755, 0o2755, 0o1777)
    assert os.getxattr(tmp_path / "usr/bin/ping", "security.capability") == CAP_NET_RAW
    assert os.lstat(tmp_path / "usr/bin/sudoedit").st_ino == os.lstat(tmp_path / "usr/bin/sudo").st_ino
    assert os.readlink(tmp_path / "bin") == "usr/bin" and os.readlink(tmp_path / "etc/alt") == "/etc/alternatives/x"
    assert not os.path.lexists(tmp_path / "dev/null")
    assert stat.S_ISFIFO(os.lstat(tmp_path / "run/fifo").st_mode)
    st_u = os.lstat(tmp_path / "home/user/f")
    assert (st_u.st_uid, st_u.st_gid, stat.S_IMODE(st_u.st_mode)) == (1000, 1000, 0o640)
    wh = os.lstat(tmp_path / "etc/motd")
    assert stat.S_ISCHR(wh.st_mode) and wh.st_rdev == 0 and not (tmp_path / "etc/.wh.motd").exists()
    assert os.getxattr(tmp_path / "srv", "trusted.overlay.opaque") == b"y"
    assert not (tmp_path / "srv/.wh..wh..opq").exists() and not (tmp_path / "x/.wh..wh.plnk").exists()


def test_not_a_tar_is_a_corrupt_layer(tmp_path: Path) -> None:
    with pytest.raises(CorruptLayer):
        unpack.unpack(io.BytesIO(b"\x01" * 1024), tmp_path)


SEGMENT = st.sampled_from(["a", "b", "..", ".", "", "c d", "é"])
NAMES = st.lists(SEGMENT, min_size=1, max_size=5).map("/".join) | st.sampled_from(
    ["/etc/passwd", "../x", "a/../../x", "./../x", "//x"])
LINKS = NAMES | st.sampled_from(["../../../etc", "/abs", "a/../..", "x"])


@SETTINGS
@given(entries=st.lists(st.tuples(NAMES, st.sampled_from(["file", "dir", "sym", "hard"]), LINKS),
                        min_size=1, max_size=6))
def test_untrusted_layers_never_write_outside(tmp_path_factory: pytest.TempPathFactory,
                                              entries: list[tuple[str, str, str]]) -> None:
    base = tmp_path_factory.mktemp("layer")
    dest, outside = base / "layer", base / "outside"
    dest.mkdir()
    outside.mkdir()
    raw = _tar(*[(n, k, {"linkname": link, "data": b"x"} if k in ("sym", "hard") else
                  {"data": b"x"} if k == "file" else {}) for n, k, link in entries])
    escapes = any(name.startswith("/") or ".." in name.split("/") for name, _, _ in entries)
    try:
        unpack.unpack(io.BytesIO(raw), dest)
    except UnsafeLayerEntry:
        pass
    else:
        # Entries with '..' or an absolute name are always refused.
        assert not escapes
    assert list(outside.iterdir()) == []
    for p in dest.rglob("*"):
        if p.is_symlink() and not os.readlink(p).startswith("/"):
            target = os.path.normpath(os.path.join(os.path.dirname(p), os.readlink(p)))
            assert target == str(dest) or target.startswith(f"{dest}/"), (p, os.readlink(p))


@pytest.mark.parametrize("name,kind,link", [
    ("../evil", "file", ""), ("/etc/evil", "file", ""), ("a/../../evil", "file", ""),
    ("h", "hard", "../outside/f"), ("h", "hard", "/etc/passwd"), ("s", "sym", "../../etc/passwd"),
    ("d/s", "sym", "../.."), ("/", "dir", ""), ("//", "dir", ""),
])
def test_refused_entries(tmp_path: Path, name: str, kind: str, link: str) -> None:
    with pytest.raises(UnsafeLayerEntry):
        unpack.unpack(io.BytesIO(_tar((name, kind, {"linkname": link}))), tmp_path)


def test_no_write_through_a_symlink(tmp_path: Path) -> None:
    dest, outside = tmp_path / "layer", tmp_path / "outside"
    dest.mkdir()
    outside.mkdir()
    raw = _tar(("d", "sym", {"linkname": "/tmp"}), ("d/evil", "file", {"data": b"x"}))
    with pytest.raises(UnsafeLayerEntry):
        unpack.unpack(io.BytesIO(raw), dest)


@SETTINGS
@given(ref=st.text(max_size=80) | st.sampled_from(
    ["docker:", "docker:../x", "docker:UPPER", "docker:a b", "docker:a;rm -rf /", "oci:relative", "oci:/a/../b",
     "registry:-x", "registry:x@sha256:zz", "docker:" + "a" * 300, "oci:/x:bad tag", "docker:--help"]))
def test_odd_references_are_typed_errors(ref: str) -> None:
    try:
        parsed = reference.parse(ref)
    except ImageReferenceError:
        return
    # What parses is a reference docker or skopeo would take: no option, space or control char.
    assert not parsed.name.startswith("-") and not any(c.isspace() or ord(c) < 32 for c in parsed.name)


@pytest.mark.parametrize("ref", ["docker:debian", "docker:debian:bookworm", "docker:localhost:5000/a/b:1",
                                 "docker:sha256:" + "a" * 64, "registry:127.0.0.1:5000/swe:1",
                                 "registry:quay.io/x/y@sha256:" + "b" * 64, "oci:/var/layout", "oci:/var/layout:v1"])
def test_good_references_parse(ref: str) -> None:
    assert str(reference.parse(ref)).startswith(ref.split(":", 1)[0])


def test_nodes_that_cannot_be_made_are_reported(tmp_path: Path) -> None:
    """A device node is never made (in a user namespace it could not be either): the unpack goes
    on, and says which entries are missing."""
    raw = _tar(("dev/null", "chr", {"devmajor": 1, "devminor": 3, "mode": 0o666}),
               ("run/fifo", "fifo", {"mode": 0o644}), ("etc/f", "file", {"data": b"x"}))
    (tmp_path / "layer.tar").write_bytes(raw)
    (tmp_path / "out").mkdir()
    code = ("import json, sys; from pathlib import Path; from bunshinfork.images import unpack; "
            "print(json.dumps(unpack.unpack(open(sys.argv[1], 'rb'), Path(sys.argv[2])).skipped))")
    proc = subprocess.run(["unshare", "--user", "--map-root-user", sys.executable, "-c", code,
                           str(tmp_path / "layer.tar"), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    skipped = json.loads(proc.stdout)
    assert len(skipped) == 1 and skipped[0].startswith("dev/null:")
    assert not (tmp_path / "out/dev/null").exists()
    assert stat.S_ISFIFO(os.lstat(tmp_path / "out/run/fifo").st_mode) and (tmp_path / "out/etc/f").read_bytes() == b"x"
