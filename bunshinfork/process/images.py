"""Fix-ups of CRIU images between the dump and the restores."""

from __future__ import annotations

import struct
from pathlib import Path

try:
    from pycriu.images import fdinfo_pb2  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - set-up installs pycriu into the venv
    fdinfo_pb2 = None

IMG_COMMON_MAGIC, FILES_MAGIC = 0x54564319, 0x56303138  # criu/include/magic.h
# Names CRIU gives its files in an image directory.
PAGES_PREFIX = "pages-"
LOG_SUFFIX = ".log"


def rearm_expired_timerfds(images: Path) -> int:
    """Make periodic timerfds keep firing in clones; returns how many entries were changed.

    The kernel stops a timerfd's hrtimer when it expires and re-arms a periodic one only when
    the ticks are read. CRIU dumps such a timer (expired, ticks unread) with it_value 0 and
    restores it with timerfd_settime(it_value=0), which disarms it: the clone reads the pending
    ticks once and the timer never fires again. Giving it one interval to its next expiry
    keeps the ticks and the period, and adds no expiration that has not happened.
    """
    path = images / "files.img"
    if fdinfo_pb2 is None or not path.exists():
        return 0
    data = path.read_bytes()
    if data[:8] != struct.pack("<II", IMG_COMMON_MAGIC, FILES_MAGIC):
        return 0  # not the image layout this parser knows: leave it alone
    head = pos = 8
    entries: list[bytes] = []
    changed = 0
    while pos < len(data):
        (size,) = struct.unpack_from("<I", data, pos)
        raw = data[pos + 4:pos + 4 + size]
        pos += 4 + size
        fe = fdinfo_pb2.file_entry()
        fe.ParseFromString(raw)
        if fe.type == fdinfo_pb2.TIMERFD and fe.HasField("tfd"):
            t = fe.tfd
            # ticks > 0 tells "expired, unread" from "disarmed": settime() to zero clears ticks.
            if t.vsec == 0 and t.vnsec == 0 and (t.isec or t.insec) and t.ticks > 0:
                t.vsec, t.vnsec = t.isec, t.insec
                raw = fe.SerializeToString()
                changed += 1
        entries.append(raw)
    if changed:
        out = bytearray(data[:head])
        for raw in entries:
            out += struct.pack("<I", len(raw)) + raw
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(out)
        tmp.replace(path)
    return changed
