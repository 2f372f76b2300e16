"""Causes of issue 39 that E2B's own suite found, pinned where CI does not run that suite yet:
envd's permissions string (Go's FileMode.String()), Remove as os.RemoveAll, a symlink's stat as
envd's (the target's type and mode, the resolved absolute target), metadata an upload replaces,
an upload's events (CREATE, CHMOD, WRITE),
gzip uploads with a bounded decompressed size, X-Metadata-* headers, the expired signature's
answer; and through `bunshin serve` with the e2b SDK: the list newest first, `mcp` accepted,
set_timeout(0) as now, metrics inside a [start, end] window, relative and `~` cwds."""

from __future__ import annotations

import datetime
import gzip
import time
from collections.abc import Iterator

import e2b
import e2b_server_support as support
import pytest

from bunshinfork import FileType, Sandbox
from bunshinfork.errors import InvalidArgumentException
from bunshinfork.files import go_filemode
from bunshinfork.serve import envd


@pytest.mark.parametrize(("mode", "text"), [
    (0o100644, "-rw-r--r--"), (0o040755, "drwxr-xr-x"), (0o120777, "Lrwxrwxrwx"), (0o020666, "Dcrw-rw-rw-"),
    (0o060660, "Drw-rw----"), (0o010600, "prw-------"), (0o140755, "Srwxr-xr-x"), (0o104755, "urwxr-xr-x"),
    (0o102755, "grwxr-xr-x"), (0o041777, "dtrwxrwxrwx"),
])
def test_permissions_are_go_filemode_strings(mode: int, text: str) -> None:
    assert go_filemode(mode) == text


def test_gzip_uploads_are_bounded_and_checked() -> None:
    assert envd.gunzip(gzip.compress(b"hello" * 100), 1 << 20) == b"hello" * 100
    bomb = gzip.compress(b"\0" * (4 << 20))  # 4 MiB from a few KiB
    assert len(bomb) < 16 << 10
    with pytest.raises(envd.UploadTooLarge):
        envd.gunzip(bomb, limit=1 << 20)
    with pytest.raises(InvalidArgumentException):
        envd.gunzip(b"not gzip at all", 1 << 20)
    with pytest.raises(InvalidArgumentException):
        envd.gunzip(gzip.compress(b"x" * 1000)[:-12], 1 << 20)  # truncated


def test_metadata_headers_and_signature_answers() -> None:
    headers = {"X-Metadata-Author": "a", "x-metadata-purpose": "b", "Content-Type": "x"}
    assert envd.upload_metadata(headers) == {"author": "a", "purpose": "b"}
    assert envd.upload_metadata({"Content-Type": "x"}) is None
    past, future = str(int(time.time()) - 120), str(int(time.time()) + 120)
    assert envd.signature_refusal({"signature": "v1_x", "signature_expiration": past}) == \
        "signature is already expired"
    assert envd.signature_refusal({"signature": "v1_x", "signature_expiration": future}) == "invalid signature"
    assert envd.signature_refusal({"signature": "v1_x"}) == "invalid signature"


def test_files_as_envd_reports_them() -> None:
    with Sandbox.create(timeout=60) as s:
        s.files.remove("/home/user/never-was")  # os.RemoveAll: no error
        s.files.remove("/home/user/no/such/parent")
        s.files.write("/home/user/d/t.txt", "hi", metadata={"a": "1"})
        s.commands.run("ln -s t.txt link && ln -s gone dangling && ln -s d dirlink", cwd="/home/user/d")
        s.commands.run("ln -s d /home/user/dirlink")
        assert s.files.get_info("/home/user/d/t.txt").permissions == "-rw-r--r--"
        assert s.files.get_info("/home/user/d").permissions == "drwxr-xr-x"
        link = s.files.get_info("/home/user/d/link")
        assert (link.type, link.mode, link.permissions, link.symlink_target) == \
            (FileType.FILE, 0o644, "Lrwxrwxrwx", "/home/user/d/t.txt")
        dangling = s.files.get_info("/home/user/d/dangling")
        assert (dangling.type, dangling.symlink_target) == (None, "/home/user/d/dangling")
        # A listing's walk follows no symlink (a link to a directory lists as one, unentered).
        names = [e.path for e in s.files.list("/home/user", depth=3)]
        assert "/home/user/dirlink" in names and not any(n.startswith("/home/user/dirlink/") for n in names)
        # An upload replaces the metadata; a rename keeps it.
        assert s.files.get_info("/home/user/d/t.txt").metadata == {"a": "1"}
        s.files.write("/home/user/d/t.txt", "again", metadata={"b": "2"})
        s.files.rename("/home/user/d/t.txt", "/home/user/d/u.txt")
        assert s.files.get_info("/home/user/d/u.txt").metadata == {"b": "2"}
        s.files.write("/home/user/d/u.txt", "plain")
        assert not s.files.get_info("/home/user/d/u.txt").metadata
        # An upload is seen as envd's: created, chowned to its user, written.
        s.files.make_dir("/home/user/w")
        handle = s.files.watch_dir("/home/user/w")
        try:
            s.files.write("/home/user/w/new.txt", "x")
            assert [e.type.value for e in handle.get_new_events()] == ["create", "chmod", "write"]
        finally:
            handle.stop()
        # A polled recursive watch: a directory made and written into between two polls.
        handle = s.files.watch_dir("/home/user/w", recursive=True)
        try:
            s.files.write("/home/user/w/sub/f.txt", "y")
            got = {(e.name, e.type.value) for e in handle.get_new_events()}
            assert {("sub", "create"), ("sub/f.txt", "create"), ("sub/f.txt", "write")} <= got
        finally:
            handle.stop()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[support.Served]:
    with support.serving(tmp_path_factory.mktemp("serve")) as s:
        yield s


def test_served_as_e2b_answers(served: support.Served) -> None:
    start = datetime.datetime.now(datetime.UTC)
    first = e2b.Sandbox.create(timeout=60)
    second = e2b.Sandbox.create(timeout=60)
    try:
        # The server takes `mcp`; the SDK then starts the gateway, which base lacks, and kills it.
        with pytest.raises(e2b.SandboxException, match="Failed to start MCP gateway"):
            e2b.Sandbox.create("base", timeout=60, mcp={"x": {}})  # type: ignore[arg-type]
        listed = [i.sandbox_id for i in e2b.Sandbox.list().next_items()]
        assert listed.index(second.sandbox_id) < listed.index(first.sandbox_id)  # newest first
        assert first.commands.run("pwd", cwd="~").stdout == "/home/user\n"
        first.files.make_dir("/home/user/sub")
        assert first.commands.run("pwd", cwd="sub").stdout == "/home/user/sub\n"
        first.files.write("/home/user/z.txt", "zz", metadata={"k": "v"})
        assert first.files.get_info("/home/user/z.txt").metadata == {"k": "v"}
        assert first.files.write("/home/user/g.txt", "g" * 1000, gzip=True).path == "/home/user/g.txt"
        assert first.files.read("/home/user/g.txt") == "g" * 1000
        deadline = time.monotonic() + 15
        while not first.get_metrics(start=start, end=datetime.datetime.now(datetime.UTC)):
            assert time.monotonic() < deadline, "no metrics sample inside [start, now]"
            time.sleep(0.5)
        assert not first.get_metrics(start=start - datetime.timedelta(hours=1),
                                     end=start - datetime.timedelta(minutes=30))
        second.set_timeout(0)  # its end is now: killed at once
        deadline = time.monotonic() + 10
        while second.is_running():
            assert time.monotonic() < deadline, "set_timeout(0) did not end the sandbox"
            time.sleep(0.2)
    finally:
        for s in (first, second):
            s.kill()  # False for one already gone


def test_started_after_its_own_start_lists_it() -> None:
    from bunshinfork.e2b.lifecycle import ListQuery
    from bunshinfork.serve import rest
    for started in (1764800000.1234567, 1764800000.9999996, time.time()):
        bound = rest._ts(rest._iso(started))  # what the SDK sends back: the startedAt it was given
        assert bound is not None and ListQuery(started_after=bound).matches({}, "running", started, "base")
        assert not ListQuery(started_after=bound + 1).matches({}, "running", started, "base")
