#!/usr/bin/env python3
"""Extract an uncompressed vmlinux from a bzImage and check it can boot through PVH.

qemu's ``-kernel`` only takes the fast PVH entry path for an ELF vmlinux that
carries a XEN_ELFNOTE_PHYS32_ENTRY note; given a bzImage it emulates the real-mode
setup code instead, which under TCG costs seconds.  Debian ships only the bzImage
and, unlike a kernel tree, no scripts/extract-vmlinux, so this does the same
search: try every compression magic found in the image until one decompresses to
an ELF file.

Usage:
    python3 kernel/vmlinux.py extract /boot/vmlinuz-X OUT
    python3 kernel/vmlinux.py check-pvh VMLINUX
"""

from __future__ import annotations

import bz2
import lzma
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

ELF_MAGIC = b"\x7fELF"
PT_NOTE = 4
XEN_ELFNOTE_PHYS32_ENTRY = 18


def _gunzip(data: bytes) -> bytes:
    # The payload is followed by the rest of the bzImage (and padding); a
    # decompressobj stops at the end of the first member instead of erroring.
    return zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(data)


def _unxz(data: bytes) -> bytes:
    return lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(data)


def _unlzma(data: bytes) -> bytes:
    return lzma.LZMADecompressor(format=lzma.FORMAT_ALONE).decompress(data)


def _unbz2(data: bytes) -> bytes:
    return bz2.BZ2Decompressor().decompress(data)


def _unzstd(data: bytes) -> bytes:
    # The stdlib has no zstd before 3.14; the zstd CLI is in every Debian image
    # that has zstd-compressed kernels.  --no-check tolerates trailing bytes.
    if shutil.which("zstd") is None:
        raise ValueError("zstd not installed")
    proc = subprocess.run(["zstd", "-dcq"], input=data, capture_output=True, check=False)
    if not proc.stdout:
        raise ValueError("zstd failed")
    return proc.stdout


# (magic, decompressor), in the order upstream scripts/extract-vmlinux tries them.
DECOMPRESSORS: list[tuple[bytes, Callable[[bytes], bytes]]] = [
    (b"\x1f\x8b\x08", _gunzip),
    (b"\xfd7zXZ\x00", _unxz),
    (b"BZh", _unbz2),
    (b"\x5d\x00\x00\x00", _unlzma),
    (b"\x28\xb5\x2f\xfd", _unzstd),
]


def _offsets(data: bytes, magic: bytes) -> Iterator[int]:
    pos = data.find(magic)
    while pos != -1:
        yield pos
        pos = data.find(magic, pos + 1)


def extract(image: bytes) -> bytes:
    """Return the ELF vmlinux embedded in a compressed kernel image."""
    if image.startswith(ELF_MAGIC):
        return image
    for magic, decompress in DECOMPRESSORS:
        for off in _offsets(image, magic):
            try:
                out = decompress(image[off:])
            except (OSError, EOFError, ValueError, lzma.LZMAError, zlib.error):
                continue
            if out.startswith(ELF_MAGIC):
                return out
    raise ValueError("no compressed ELF payload found in kernel image")


def elf_notes(elf: bytes) -> Iterator[tuple[bytes, int, bytes]]:
    """Yield (name, type, desc) for every note in the PT_NOTE segments of a 64-bit LE ELF."""
    if not elf.startswith(ELF_MAGIC) or elf[4] != 2 or elf[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    (e_phoff,) = struct.unpack_from("<Q", elf, 0x20)
    e_phentsize, e_phnum = struct.unpack_from("<HH", elf, 0x36)
    for i in range(e_phnum):
        p_type, _flags, p_offset, _vaddr, _paddr, p_filesz = struct.unpack_from(
            "<IIQQQQ", elf, e_phoff + i * e_phentsize
        )
        if p_type != PT_NOTE:
            continue
        pos, end = p_offset, p_offset + p_filesz
        while pos + 12 <= end:
            namesz, descsz, ntype = struct.unpack_from("<III", elf, pos)
            pos += 12
            name = elf[pos : pos + namesz].rstrip(b"\0")
            pos += (namesz + 3) & ~3
            desc = elf[pos : pos + descsz]
            pos += (descsz + 3) & ~3
            yield name, ntype, desc


def pvh_entry(elf: bytes) -> int | None:
    """The 32-bit PVH entry address, or None when the kernel was built without CONFIG_PVH."""
    for name, ntype, desc in elf_notes(elf):
        if name == b"Xen" and ntype == XEN_ELFNOTE_PHYS32_ENTRY and len(desc) >= 4:
            return int(struct.unpack_from("<I", desc)[0])
    return None


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "extract":
        out = extract(Path(argv[1]).read_bytes())
        entry = pvh_entry(out)
        if entry is None:
            print(f"{argv[1]}: no PVH entry note (CONFIG_PVH off?)", file=sys.stderr)
            return 1
        dest = Path(argv[2])
        # Write then rename so a concurrent boot never sees a half-written kernel.
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=dest.name + ".")
        with os.fdopen(fd, "wb") as f:
            f.write(out)
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
        print(f"{dest}: {len(out)} bytes, PVH entry {entry:#x}")
        return 0
    if len(argv) == 2 and argv[0] == "check-pvh":
        entry = pvh_entry(Path(argv[1]).read_bytes())
        if entry is None:
            print(f"{argv[1]}: no PVH entry note", file=sys.stderr)
            return 1
        print(f"PVH entry {entry:#x}")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
