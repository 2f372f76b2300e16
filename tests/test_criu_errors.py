"""A failed CRIU call says why it failed. On a host whose capability bounding set lacks
CAP_SYS_RESOURCE (this one), every CRIU logs "Can't setup RLIMIT_NOFILE for self" as its first
error and carries on; that line used to be all a ForkError said, hiding the real cause."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bunshinfork.errors import CriuError
from bunshinfork.process import criu


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_failed_dump_names_its_cause_not_the_rlimit_line(tmp_path: Path) -> None:
    images = tmp_path / "images"
    images.mkdir()
    opts = criu.new_opts()
    opts.images_dir = str(images)
    opts.pid = _dead_pid()
    opts.log_file = "dump.log"
    opts.log_level = 4
    with pytest.raises(CriuError) as e:
        criu.request("dump", opts, log=images / "dump.log", timeout=30)
    text = str(e.value)
    assert not any(criu.is_noise(line) for line in text.splitlines()), text
    # CRIU's own words for a task it cannot seize; what the log holds decides, not this test
    log = (images / "dump.log").read_text()
    real = [ln for ln in log.splitlines() if "Error" in ln and not criu.is_noise(ln)]
    assert real, log
    assert real[-1].split("): ", 1)[-1] in text


def test_the_noise_is_skipped_in_the_reply_and_the_log(tmp_path: Path) -> None:
    log = tmp_path / "restore.log"
    log.write_text(
        "(00.01) Error (criu/util.c:1534): rlimit: Can't setup RLIMIT_NOFILE for self: "
        "Operation not permitted\n(00.02) Error (criu/net.c:1): ipv4: Address already in use\n")
    resp = criu.rpc.criu_resp()
    resp.type = criu.rpc.RESTORE
    resp.success = False
    resp.cr_errmsg = "rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted"
    msg = criu.failure("restore", resp, log)
    assert msg.splitlines()[0] == "criu restore failed"
    assert "Address already in use" in msg and "RLIMIT_NOFILE" not in msg
    resp.cr_errmsg = "ipv4: Address already in use"
    assert criu.failure("restore", resp, log).splitlines()[0] == "criu restore failed: ipv4: Address already in use"
