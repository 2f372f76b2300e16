"""Container images as workspaces (bunshinfork.images), against a real dockerd, skopeo and
Debian's docker-registry, all on this machine (tests/images_support.py)."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from images_support import (
    APP,
    BASE,
    DEEP,
    DEEP_LAYERS,
    SWE,
    Engine,
    _debs,
    build_images,
    dockerd,
    registry,
    skopeo,
)

from bunshinfork import Workspace, images
from bunshinfork.e2b import Sandbox
from bunshinfork.errors import (
    CorruptLayer,
    EngineUnavailable,
    ImageError,
    ImageNotFound,
    TemplateNotFound,
    TemplateNotReady,
    UnsupportedMediaType,
)
from bunshinfork.fs import frozen
from bunshinfork.images import store, templates, warm

pytestmark = pytest.mark.skipif(not os.path.exists("/usr/sbin/dockerd"), reason="needs docker.io (scripts/setup.sh)")


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    root = tmp_path_factory.mktemp("engine")
    saved = os.environ.get("DOCKER_HOST")
    with dockerd(root) as eng:
        os.environ["DOCKER_HOST"] = eng.host
        try:
            build_images(eng)
            yield eng
        finally:
            if saved is None:
                os.environ.pop("DOCKER_HOST", None)
            else:
                os.environ["DOCKER_HOST"] = saved


def _out(ws: Workspace, cmd: str, **kw) -> str:
    r = ws.commands.run(cmd, **kw)
    assert r.exit_code == 0, (cmd, r.stdout, r.stderr)
    return r.stdout.strip()


CHECKS = ("id -un; pwd; echo $GREETING; ls /srv/opq; ls /opt; test -e /etc/debian_version && echo has-version; "
          "stat -c %A /usr/bin/sudo")


def test_image_layers_config_setuid_caps_and_whiteouts(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    info = json.loads(engine.docker("image", "inspect", APP))[0]
    diff_ids = info["RootFS"]["Layers"]
    with Workspace.create(rootfs=f"docker:{APP}") as ws:
        lowers = ws._rec.fs.rootfs.lowerdirs
        # One lower per layer, top first, each a short link into the layer store.
        assert len(lowers) == len(set(diff_ids))
        assert [os.path.realpath(p) for p in lowers] == [str(store.path(d)) for d in reversed(diff_ids)]
        # Env, WorkingDir and User apply, and the whiteouts and opaque directory show as in docker run.
        ours = _out(ws, CHECKS)
        theirs = engine.docker("run", "--rm", "--network", "none", "--entrypoint", "/bin/bash", APP, "-c", CHECKS)
        assert ours == theirs.strip()
        assert ours.splitlines()[:4] == ["user", "/work", "hello", "new"]
        assert "has-version" not in ours and "drop" not in ours
        assert _out(ws, "sudo -n id -u") == "0"  # the setuid bit survived
        assert "cap_net_raw=ep" in _out(ws, "/sbin/getcap /usr/local/bin/rawping")
        assert ws.info().exposed_ports == ("8080/tcp",)
        assert _out(ws, "id -un", user="root") == "root"
    # Every diff_id is stored now: the next create asks the engine only for the image's config.
    assert all(store.has(d) for d in diff_ids)
    from bunshinfork.images import docker_engine

    def no_save(*args: object) -> None:
        raise AssertionError("the image was saved again although its layers are stored")

    monkeypatch.setattr(docker_engine, "_save_layers", no_save)
    with Workspace.create(rootfs=f"docker:{APP}") as ws:
        assert _out(ws, "echo $GREETING") == "hello"


def test_entrypoint_serves_its_port(engine: Engine) -> None:
    with Workspace.create(rootfs=f"docker:{APP}", start="entrypoint") as ws:
        fetch = "python3 -c \"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8080/').status)\""
        r = None
        for _ in range(100):  # the server binds shortly after it starts
            r = ws.commands.run(fetch, timeout=10)
            if r.exit_code == 0:
                break
            ws.commands.run("sleep 0.1")
        assert r is not None and r.exit_code == 0 and r.stdout.strip() == "200", r


def test_forty_layer_image_mounts_and_forks(engine: Engine) -> None:
    with Workspace.create(rootfs=f"docker:{DEEP}") as ws:
        fs = ws._rec.fs
        assert len(fs.rootfs.lowerdirs) == DEEP_LAYERS
        assert len(frozen.overlay_options(fs.lowers, fs.rootfs.lowerdirs, fs.layer)) < frozen.MAX_OPTIONS
        _out(ws, "echo source > /tmp/mark")
        (clone,) = ws.fork(1)
        try:
            assert not isinstance(clone, BaseException), clone
            assert _out(clone, f"cat /layers/1 /layers/{DEEP_LAYERS - 1} /tmp/mark") == f"1\n{DEEP_LAYERS - 1}\nsource"
            # The clone stacks the image's layers as they are, under its snapshot's frozen layer.
            assert clone._rec.fs.rootfs.lowerdirs == fs.rootfs.lowerdirs and len(clone._rec.fs.lowers) == 1
        finally:
            clone.destroy()


PATCHES = {
    "plus": "return a + b",
    "swapped": "return b + a",
    "summed": "return sum((a, b))",
    "wrong": "return a * b",
}


def test_swe_like_image_forks_four_ways(engine: Engine) -> None:
    with Workspace.create(rootfs=f"docker:{SWE}") as ws:
        assert ws.commands.run("python3 test_calc.py").exit_code != 0  # fails until patched
        clones = ws.fork(len(PATCHES))
        try:
            assert not any(isinstance(c, BaseException) for c in clones), clones
            for clone, (name, line) in zip(clones, PATCHES.items(), strict=True):
                _out(clone, f"python3 -c \"import pathlib; p = pathlib.Path('calc.py'); "
                            f"p.write_text(p.read_text().replace('return a - b', '{line}')); "
                            f"open('/tmp/patch', 'w').write('{name}\\n')\"")
            for clone, (name, line) in zip(clones, PATCHES.items(), strict=True):
                assert _out(clone, "cat /tmp/patch; grep return calc.py") == f"{name}\n    {line}"
                passed = clone.commands.run("python3 test_calc.py").exit_code == 0
                assert passed == (name != "wrong")
            assert _out(ws, "grep return calc.py; test ! -e /tmp/patch && echo clean") == "return a - b\nclean"
        finally:
            for c in clones:
                if not isinstance(c, BaseException):
                    c.destroy()


def _resident(path: Path) -> int:
    """Pages of `path` in the host's page cache (mincore)."""
    size = path.stat().st_size
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        start = ctypes.c_char.from_buffer(m)
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.mincore(ctypes.c_void_p(ctypes.addressof(start)), ctypes.c_size_t(size), vec) == 0
        del start  # the mapping cannot close while a ctypes view holds it
        return sum(v & 1 for v in vec)


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_images_sharing_a_base_share_its_page_cache(engine: Engine) -> None:
    with Workspace.create(rootfs=f"docker:{APP}") as a, Workspace.create(rootfs=f"docker:{SWE}") as b:
        base = a._rec.fs.rootfs.lowerdirs[-1]
        assert b._rec.fs.rootfs.lowerdirs[-1] == base  # one copy of the base on disk
        host_file = Path(os.path.realpath(base)) / "usr/bin/python3.11"
        for ws in (a, b):
            _evict(host_file)
            assert _resident(host_file) < 8
            _out(ws, "cat /usr/bin/python3.11 > /dev/null", user="root")
            # The workspace's read filled the base layer's own pages: both read the one copy.
            assert _resident(host_file) * mmap.PAGESIZE >= host_file.stat().st_size * 0.9


def test_registry_and_oci_layout(engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = tmp_path / "layout"
    skopeo(f"docker-daemon:{SWE}", f"oci:{layout}:v1", engine=engine)
    with registry(tmp_path) as where:
        skopeo("--dest-tls-verify=false", f"docker-daemon:{SWE}", f"docker://{where}/swe:1", engine=engine)
        with Workspace.create(rootfs=f"registry:{where}/swe:1") as ws:
            assert _out(ws, "pwd; cat calc.py") == "/repo\n" + CALC_TEXT
        with pytest.raises(ImageNotFound):
            Workspace.create(rootfs=f"registry:{where}/nothing:1")
        # TLS verified on demand even on loopback: this registry speaks plain HTTP.
        monkeypatch.setenv("BUNSHIN_REGISTRY_TLS_VERIFY", "1")
        with pytest.raises(ImageError, match="HTTPS") as refused:
            Workspace.create(rootfs=f"registry:{where}/swe:other")
        assert not isinstance(refused.value, ImageNotFound)
    with Workspace.create(rootfs=f"oci:{layout}:v1") as ws:
        assert _out(ws, "cat /repo/calc.py") == CALC_TEXT
    with pytest.raises(ImageNotFound):
        Workspace.create(rootfs=f"oci:{layout}:v2")


CALC_TEXT = "def add(a, b):\n    return a - b"


def _corrupt_layout(src: Path, dest: Path, media: str | None = None) -> None:
    """A copy of an OCI layout whose last layer's diff_id is wrong (or whose media type is `media`)."""
    subprocess.run(["cp", "-a", str(src), str(dest)], check=True, timeout=60)
    blobs = dest / "blobs" / "sha256"
    index = json.loads((dest / "index.json").read_text())
    man_digest = index["manifests"][0]["digest"].split(":")[1]
    man = json.loads((blobs / man_digest).read_text())
    cfg = json.loads((blobs / man["config"]["digest"].split(":")[1]).read_text())
    if media is None:
        cfg["rootfs"]["diff_ids"][-1] = "sha256:" + "0" * 64
    else:
        man["layers"][-1]["mediaType"] = media
    raw_cfg = json.dumps(cfg).encode()
    man["config"]["digest"] = store.image_id(raw_cfg)
    (blobs / man["config"]["digest"].split(":")[1]).write_bytes(raw_cfg)
    raw_man = json.dumps(man).encode()
    index["manifests"][0]["digest"] = store.image_id(raw_man)
    index["manifests"][0]["size"] = len(raw_man)
    (blobs / index["manifests"][0]["digest"].split(":")[1]).write_bytes(raw_man)
    (dest / "index.json").write_text(json.dumps(index))


def test_typed_errors(engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ImageNotFound):
        Workspace.create(rootfs="docker:bunshin-test/missing:1")
    layout = tmp_path / "layout"
    # A layer of its own, so that the corrupt copies' last layer is not in the store yet.
    engine.build("bunshin-test/odd:1", f"FROM {BASE}\nCOPY odd /odd\n", files={"odd": os.urandom(64)})
    skopeo("docker-daemon:bunshin-test/odd:1", f"oci:{layout}:v1", engine=engine)
    _corrupt_layout(layout, tmp_path / "corrupt")
    before = store.temporaries()
    with pytest.raises(CorruptLayer):
        Workspace.create(rootfs=f"oci:{tmp_path / 'corrupt'}:v1")
    assert store.temporaries() == before  # nothing half-unpacked is left or used
    _corrupt_layout(layout, tmp_path / "bzip2", media="application/vnd.oci.image.layer.v1.tar+bzip2")
    with pytest.raises(UnsupportedMediaType):
        Workspace.create(rootfs=f"oci:{tmp_path / 'bzip2'}:v1")
    # Labelled zstd, but an uncompressed tar: the decoder refuses it, and nothing is kept.
    _corrupt_layout(layout, tmp_path / "zstd", media="application/vnd.oci.image.layer.v1.tar+zstd")
    with pytest.raises(CorruptLayer, match="decompress"):
        Workspace.create(rootfs=f"oci:{tmp_path / 'zstd'}:v1")
    assert store.temporaries() == before
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")
    with pytest.raises(EngineUnavailable):
        Workspace.create(rootfs=f"docker:{APP}")


def test_zstd_layers(engine: Engine, tmp_path: Path) -> None:
    # Content of its own (random): a layer the store has not seen, whatever ran before.
    z = f"{os.urandom(8).hex()}\n".encode() + b"zstd layer\n" * 999
    engine.build("bunshin-test/zstd:1", f"FROM {BASE}\nCOPY z /z\n", files={"z": z})
    layout = tmp_path / "layout"
    skopeo("--dest-compress-format", "zstd", "docker-daemon:bunshin-test/zstd:1", f"oci:{layout}:v1", engine=engine)
    index = json.loads((layout / "index.json").read_text())
    man = json.loads((layout / "blobs" / "sha256" / index["manifests"][0]["digest"].split(":")[1]).read_text())
    assert {lay["mediaType"] for lay in man["layers"]} == {"application/vnd.oci.image.layer.v1.tar+zstd"}
    top = json.loads(engine.docker("image", "inspect", "bunshin-test/zstd:1"))[0]["RootFS"]["Layers"][-1]
    assert not store.has(top)  # its own layer: this create unpacks it from zstd
    with Workspace.create(rootfs=f"oci:{layout}:v1") as ws:
        assert _out(ws, "wc -l < /z") == "1000"
    assert store.has(top)


COUNT = "/var/tmp/counts"
START = f"echo start >> {COUNT}; exec python3 -m http.server --bind 127.0.0.1 8081"
READY = (f"echo ready >> {COUNT}; python3 -c \"import urllib.request; "
         "urllib.request.urlopen('http://127.0.0.1:8081/')\"")


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bunshinfork.cli", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_templates_start_warm(engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(templates, "ROOT", tmp_path / "saved")
    env = {**os.environ, "BUNSHIN_SNAPSHOT_ROOT": str(tmp_path / "saved")}
    made = _cli("template", "create", "web", "--from", SWE, "--start", START, "--ready", READY,
                "--ready-timeout", "60", env=env)
    assert made.returncode == 0, made.stderr
    listed = _cli("template", "ls", "--json", env=env)
    rows = json.loads(listed.stdout)
    assert [(r["name"], r["kind"], r["source"]) for r in rows] == [("web", "template", f"docker:{SWE}")]
    # The saved snapshot's image lowers resolve from the layer store, with no engine to ask.
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")
    env["DOCKER_HOST"] = f"unix://{tmp_path}/no-engine.sock"
    with Workspace.create(template="web") as ws:
        counts = _out(ws, f"cat {COUNT}").splitlines()
        assert counts[0] == "start" and counts.count("start") == 1 and set(counts[1:]) == {"ready"}
        # Warm: the server the start command launched is up, and neither command ran again.
        _out(ws, READY.replace(f"echo ready >> {COUNT}; ", ""))
        assert _out(ws, f"cat {COUNT}").splitlines() == counts
    made = _cli("create", "--template", "web", env=env)
    assert made.returncode == 0, made.stderr
    ws = Workspace.connect(made.stdout.strip())
    try:
        assert _out(ws, f"grep -c start {COUNT}") == "1"
    finally:
        ws.destroy()
    assert _cli("template", "rm", "web", env=env).returncode == 0
    assert json.loads(_cli("template", "ls", "--json", env=env).stdout) == []
    with pytest.raises(TemplateNotFound):
        Workspace.create(template="web")


def test_template_never_ready_leaves_nothing(engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(templates, "ROOT", tmp_path / "saved")
    with pytest.raises(TemplateNotReady):
        warm.create("never", f"docker:{SWE}", ready="false", ready_timeout=2)
    assert templates.ls() == []
    assert not (tmp_path / "saved").exists() or not any((tmp_path / "saved").iterdir())


NOSUDO_IMAGE = "bunshin-test/swe-nosudo:1"
SUDO_IMAGE = "bunshin-test/sudo-nouser:1"  # sudo, no "user", a User and WorkingDir of its own
E2B_CHECKS = "id -un; pwd; echo $HOME; stat -c %U $HOME; sudo -n id -u"


def _e2b_user_with_sudo(sbx: Sandbox) -> None:
    """E2B's conventions hold whatever the image's User: commands run as "user", whom the
    sandbox added (home /home/user, theirs) with the password-less sudo E2B's build gives."""
    r = sbx.commands.run(E2B_CHECKS)
    assert r.stdout.split("\n")[:5] == ["user", "/srv", "/home/user", "user", "0"], r.stdout
    assert sbx.commands.run("stat -c '%U %a' /etc/sudoers").stdout.strip() == "root 440"


def test_e2b_sandbox_from_an_image_runs_as_user(engine: Engine, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    engine.build(SUDO_IMAGE, f"""FROM {BASE}
COPY debs/ /tmp/debs/
RUN dpkg -i /tmp/debs/*.deb && rm -rf /tmp/debs
WORKDIR /srv
USER nobody
""", dirs={"debs": _debs()})
    with Workspace.create(rootfs=f"docker:{SUDO_IMAGE}") as ws:  # a Workspace honours the image's User
        assert _out(ws, "id -un; grep -c '^user:' /etc/passwd || true") == "nobody\n0"
    layout = tmp_path / "layout"
    skopeo(f"docker-daemon:{SUDO_IMAGE}", f"oci:{layout}:v1", engine=engine)
    with registry(tmp_path) as where:
        skopeo("--dest-tls-verify=false", f"docker-daemon:{SUDO_IMAGE}", f"docker://{where}/sudo:1", engine=engine)
        for template in (f"docker:{SUDO_IMAGE}", f"oci:{layout}:v1", f"registry:{where}/sudo:1"):
            sbx = Sandbox.create(template)
            try:
                _e2b_user_with_sudo(sbx)
            finally:
                sbx.kill()
    # An image without sudo (the base rootfs has it: it is purged here): "user" is added all
    # the same, and no sudoers appears.
    engine.build(NOSUDO_IMAGE, f"FROM {SWE}\nRUN SUDO_FORCE_REMOVE=yes dpkg --purge sudo && test ! -e /etc/sudoers\n")
    sbx = Sandbox.create(f"docker:{NOSUDO_IMAGE}")
    try:
        assert sbx.commands.run("id -un; pwd; test -e /etc/sudoers || echo none").stdout.split() == \
            ["user", "/repo", "none"]
    finally:
        sbx.kill()
    # A warm template made from the image: its clones are sandboxes like the others.
    monkeypatch.setattr(templates, "ROOT", tmp_path / "saved")
    warm.create("e2b-from-image", f"docker:{SUDO_IMAGE}", ready="true", ready_timeout=30)
    sbx = Sandbox.create("e2b-from-image")
    try:
        _e2b_user_with_sudo(sbx)
    finally:
        sbx.kill()
        templates.rm("e2b-from-image")


def test_gc_leaves_the_store_and_removes_abandoned_unpacks(engine: Engine) -> None:
    store.LAYERS.mkdir(parents=True, exist_ok=True)
    abandoned = store.LAYERS / f"{store.TMP}{'f' * 64}-x"
    abandoned.mkdir()
    (abandoned / "half").write_text("x")
    layers_before = {p.name for p in store.LAYERS.iterdir() if not p.name.startswith(".")}
    removed = images.store.gc()
    assert str(abandoned) in removed and not abandoned.exists()
    assert {p.name for p in store.LAYERS.iterdir() if not p.name.startswith(".")} == layers_before
    from bunshinfork import pipeline

    pipeline.gc()
    assert store.temporaries() == set()


def test_an_image_runs_in_a_user_namespace_in_serve_and_the_library(engine: Engine, tmp_path: Path) -> None:
    """Images are untrusted: in a user namespace their root is a host id of the shared range
    (issue 36 item 11), in the library (userns=True) and by default in `bunshin serve` (a
    `docker:` template the operator allowed), a clone of it included."""
    with Workspace.create(rootfs=f"docker:{SWE}", userns=True) as ws:
        [clone] = ws.fork(1)
        try:
            for w in (ws, clone):
                assert _out(w, "cat /proc/self/uid_map").split()[:2] == ["0", "100000"]
                assert _out(w, "pwd") == "/repo"  # the image's own WorkingDir and files
        finally:
            clone.destroy()
    import e2b
    import e2b_server_support as support

    with support.serving(tmp_path, ("--allow-template", f"docker:{SWE}")):
        sbx = e2b.Sandbox.create(f"docker:{SWE}", timeout=120)
        try:
            r = sbx.commands.run("cat /proc/self/uid_map; pwd", timeout=60)
            assert r.stdout.split()[:2] == ["0", "100000"] and r.stdout.split()[-1] == "/repo", r.stdout
            [fork] = sbx.fork()
            try:
                assert fork.commands.run("cat /proc/self/uid_map", timeout=60).stdout.split()[:2] == ["0", "100000"]
            finally:
                fork.kill()
        finally:
            sbx.kill()
