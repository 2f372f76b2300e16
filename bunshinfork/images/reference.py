"""Image references, checked before any tool sees them.

- docker:IMAGE        a name as the Docker engine takes it ([domain[:port]/]path[:tag][@digest]),
                      or an image id (sha256:<hex>, or 12 or more hex digits)
- oci:DIR[:TAG]       an OCI image layout directory (absolute), and the tag it indexes
- registry:REF        a registry reference ([domain[:port]/]path[:tag][@digest])
The grammar is the distribution project's (reference/regexp.go), so a reference these accept is
one docker and skopeo accept too; anything else is an ImageReferenceError, never passed on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import ImageReferenceError

_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN_PART = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"(?:{_DOMAIN_PART}(?:\.{_DOMAIN_PART})*|\[[0-9a-fA-F:]+\])(?::[0-9]{{1,5}})?"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
_NAME = rf"(?:{_DOMAIN}/)?{_COMPONENT}(?:/{_COMPONENT})*"
REFERENCE = re.compile(rf"({_NAME})(?::({_TAG}))?(?:@({_DIGEST}))?", re.ASCII)
IMAGE_ID = re.compile(r"(?:sha256:[0-9a-f]{64}|[0-9a-f]{12,64})", re.ASCII)
NAME_MAX = 255
KINDS = ("docker", "oci", "registry")


@dataclass(frozen=True)
class Reference:
    kind: str  # docker | oci | registry
    name: str  # the engine's or registry's reference, or the layout directory
    tag: str | None = None  # oci: the layout's ref.name

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}" + (f":{self.tag}" if self.tag else "")


def is_image(source: str) -> bool:
    return isinstance(source, str) and source.split(":", 1)[0] in KINDS and ":" in source


def _check_name(ref: str, what: str) -> str:
    if not ref or len(ref) > NAME_MAX + 200:
        raise ImageReferenceError(f"{what} reference {ref!r} is empty or too long")
    if IMAGE_ID.fullmatch(ref) and what == "docker":
        return ref
    m = REFERENCE.fullmatch(ref)
    if not m or len(m.group(1)) > NAME_MAX:
        raise ImageReferenceError(
            f"{what} reference {ref!r} is not an image reference: use [registry[:port]/]name[:tag][@sha256:...] "
            "with a lower-case name")
    return ref


def parse(source: str) -> Reference:
    """The reference a rootfs string names, or ImageReferenceError."""
    if not isinstance(source, str) or "\0" in source:
        raise ImageReferenceError(f"image reference {source!r} is not a string without NUL")
    kind, sep, rest = source.partition(":")
    if not sep or kind not in KINDS:
        raise ImageReferenceError(f"{source!r} is not an image reference: use docker:IMAGE, oci:DIR[:TAG] "
                                  "or registry:REF")
    if kind == "oci":
        directory, tag = rest, None
        head, colon, tail = rest.rpartition(":")
        if colon and "/" not in tail:
            directory, tag = head, tail
            if not re.fullmatch(_TAG, tag, re.ASCII):
                raise ImageReferenceError(f"OCI layout tag {tag!r} is not a tag (letters, digits, '_', '.', '-')")
        if not directory.startswith("/") or any(p == ".." for p in directory.split("/")):
            raise ImageReferenceError(f"OCI layout {directory!r} must be an absolute path without '..'")
        return Reference("oci", directory, tag)
    return Reference(kind, _check_name(rest, kind))
