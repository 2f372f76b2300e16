"""Which templates the server's clients may start from: an allowlist, since a template names
what the host reads or dials for them (a directory of the host, an OCI layout on its disk, a
registry it connects to).

Always offered: `base`, `debian`, this server's snapshots and the host's warm templates (those
rest.Rest.stored resolves). Beyond them only what the operator names with `bunshin serve`'s flags:

- `--allow-template T` (repeatable): `T` exactly, or for `docker:` and `registry:` a pattern with
  `*` (`docker:python:*`, `registry:ghcr.io/acme/*`). A directory or `oci:DIR[:TAG]` only exactly.
- `--allow-images`: any `docker:IMAGE` (through the host's Docker engine, its own registries and
  credentials) and any `registry:REF` whose registry is a public name or address: not `localhost`
  or `*.localhost`, not a loopback, private, link-local or otherwise non-global address.
- `--allow-registry HOST[:PORT]` (repeatable): any `registry:REF` from that registry, loopback and
  private ones included (the way to offer a registry on the host or the LAN).

Names are compared as the image grammar parses them (images/reference.py), so a reference that
the check reads one way cannot be pulled another. Registry names are not resolved here: a name
that resolves to a private address is the operator's to keep off `--allow-images` hosts.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import re
from dataclasses import dataclass

from ..e2b.templates import DEFAULT
from ..errors import ImageReferenceError, InvalidArgumentException
from ..images import reference

ALWAYS = (DEFAULT, "debian")
DOCKER_HUB = "docker.io"


def registry_of(ref: str) -> str:
    """The registry (host[:port], lower-case) a checked `registry:` reference names; Docker Hub
    when its first component is no domain (the distribution project's rule)."""
    first, sep, _ = ref.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost" or first.startswith("[")):
        return first.lower()
    return DOCKER_HUB


def public(registry: str) -> bool:
    """A registry that is a global address, or a name that is not localhost's and that no
    resolver could read as an address (`127.1`, `0x7f.1`: getaddrinfo takes inet_aton's forms)."""
    host = registry[1:registry.find("]")] if registry.startswith("[") else registry.split(":", 1)[0]
    try:
        return ipaddress.ip_address(host).is_global
    except ValueError:
        pass
    if host == "localhost" or host.endswith(".localhost") or "." not in host:
        return False
    return not re.fullmatch(r"[0-9a-fA-Fx.]+", host)


@dataclass(frozen=True)
class TemplatePolicy:
    templates: tuple[str, ...] = ()
    images: bool = False
    registries: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for t in self.templates:
            kind = t.partition(":")[0] if reference.is_image(t) else ""
            if "*" in t and kind not in ("docker", "registry"):
                raise InvalidArgumentException(
                    f"--allow-template {t!r}: '*' patterns are for docker: and registry: references; "
                    "name a directory or an oci: layout exactly")
            if not ("*" in t or t.startswith("/") or kind):
                raise InvalidArgumentException(
                    f"--allow-template {t!r}: name an image (docker:, registry:, oci:) or a directory "
                    f"({', '.join(ALWAYS)}, snapshots and warm templates are always offered)")
        for r in self.registries:
            if not r or "/" in r or r != r.strip() or registry_of(f"{r}/x") != r.lower():
                raise InvalidArgumentException(f"--allow-registry {r!r}: name a registry as HOST[:PORT]")

    def allows(self, template: str) -> bool:
        """May a client start from `template` (one of base, debian, an image or a directory)?"""
        if template in ALWAYS:
            return True
        if template.startswith("/"):
            return template in self.templates
        try:
            ref = reference.parse(template)
        except ImageReferenceError:
            return False
        if ref.kind == "oci":
            return template in self.templates
        if any(fnmatch.fnmatchcase(template, t) for t in self.templates):
            return True
        if ref.kind == "docker":
            return self.images
        registry = registry_of(ref.name)
        return registry in {r.lower() for r in self.registries} or (self.images and public(registry))


__all__ = ["ALWAYS", "TemplatePolicy", "public", "registry_of"]
