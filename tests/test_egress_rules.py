"""Egress policies as data: E2B's network rules parsed, normalised and refused (no host state)."""

from __future__ import annotations

import ssl
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bunshinfork.errors import SpecError
from bunshinfork.network.egress import ALL_TRAFFIC, CLOSED, EgressPolicy, from_e2b, parse
from bunshinfork.network.policy import E2B_DEFAULT_DNS
from bunshinfork.network.sniproxy import NeedMore, name_matches, requested_name
from bunshinfork.spec import WorkspaceSpec


def test_e2b_shapes_become_policies() -> None:
    assert from_e2b(None) is None
    assert from_e2b({}) is None
    assert from_e2b({"deny_out": [ALL_TRAFFIC], "allow_out": ["8.8.8.8"]}) == EgressPolicy(
        ("8.8.8.8/32",), (ALL_TRAFFIC,))
    assert from_e2b({"allow_public_traffic": True}) is None
    assert from_e2b(None, allow_internet_access=False) == CLOSED
    assert from_e2b({"allow_out": ["1.1.1.1"]}, allow_internet_access=False) == EgressPolicy(
        ("1.1.1.1/32",), (ALL_TRAFFIC,))


@pytest.mark.parametrize("bad", [
    {"rules": []}, {"egress_proxy": "http://p"}, {"dns_servers": ["1.1.1.1"]}, {"allow_out": "1.1.1.1"},
    {"deny_out": ["example.com"]}, {"deny_out": ["*.example.com"]}, {"allow_out": ["10.0.0.0/33"]},
    {"allow_out": ["::/0"]}, {"nonsense": 1}, {"allow_public_traffic": False},
])
def test_e2b_fields_that_cannot_apply_are_spec_errors(bad: dict) -> None:
    with pytest.raises(SpecError):
        from_e2b(bad)


def test_spec_normalises_egress() -> None:
    spec = WorkspaceSpec(network="bridge", egress={"deny_out": ["192.0.2.7", "192.0.2.7/32"]}).validate()
    assert spec.egress == {"allow_out": [], "deny_out": ["192.0.2.7/32"]}
    assert WorkspaceSpec(egress="closed").validate().egress == CLOSED.to_dict()
    assert parse(spec.egress) == EgressPolicy((), ("192.0.2.7/32",))


@settings(max_examples=200)
@given(st.one_of(st.none(), st.text(), st.integers(), st.lists(st.text()),
                 st.dictionaries(st.sampled_from(["allow_out", "deny_out", "rules", "x"]),
                                 st.one_of(st.text(), st.lists(st.text(max_size=20), max_size=3)))))
def test_any_egress_value_parses_or_is_a_spec_error(value: object) -> None:
    try:
        policy = parse(value)
    except SpecError:
        return
    assert policy is None or isinstance(policy, EgressPolicy)


# ---- domain rules ----

@pytest.mark.parametrize("bad", ["*", "*.", "*.*.example.com", "foo*.example.com", "exa mple.com", "a..b.com",
                                 "-a.example.com", "a-.example.com", "localhost", "1.2.3", "x" * 64 + ".com",
                                 ".".join(["abcdefgh"] * 30) + ".com", "http://example.com", "example.com/x",
                                 "example.com:443", "*example.com", ""])
def test_malformed_domain_rules_are_spec_errors(bad: str) -> None:
    with pytest.raises(SpecError):
        parse({"allow_out": [bad], "deny_out": [ALL_TRAFFIC]})


def test_domain_rules_parse_and_normalise() -> None:
    policy = parse({"allow_out": ["PyPI.org.", "*.GitHub.com", "*.com", "10.1.2.3", "pypi.org"],
                    "deny_out": [ALL_TRAFFIC]})
    assert policy == EgressPolicy(("10.1.2.3/32",), (ALL_TRAFFIC,), ("pypi.org", "*.github.com", "*.com"))
    assert policy.needs_proxy and not policy.closed
    assert parse(policy.to_dict()) == policy
    # With nothing denied, everything is allowed already: no proxy.
    assert not parse({"allow_out": ["pypi.org"]}).needs_proxy  # type: ignore[union-attr]
    spec = WorkspaceSpec(network="bridge", egress={"allow_out": ["Example.test"], "deny_out": [ALL_TRAFFIC]})
    assert spec.validate().egress == {"allow_out": ["example.test"], "deny_out": [ALL_TRAFFIC]}


def test_e2b_domain_rules_allow_e2b_default_resolver() -> None:
    assert from_e2b({"allow_out": ["pypi.org"], "deny_out": [ALL_TRAFFIC]}) == EgressPolicy(
        (E2B_DEFAULT_DNS,), (ALL_TRAFFIC,), ("pypi.org",))
    assert from_e2b({"allow_out": ["*.github.com"]}, allow_internet_access=False) == EgressPolicy(
        (E2B_DEFAULT_DNS,), (ALL_TRAFFIC,), ("*.github.com",))


@pytest.mark.parametrize(("name", "allowed"), [
    ("pypi.org", True), ("PYPI.ORG.", True), ("www.pypi.org", False), ("pypi.org.evil.com", False),
    ("api.github.com", True), ("a.b.c.github.com", True), ("github.com", False), ("evilgithub.com", False),
    ("", False), ("198.51.100.2", False), ("pypi.org\x00", False), ("a..github.com", False),
])
def test_names_match_exactly_or_under_a_wildcard(name: str, allowed: bool) -> None:
    assert name_matches(name, ("pypi.org", "*.github.com")) is allowed


@pytest.mark.parametrize(("head", "host"), [
    (b"GET / HTTP/1.1\r\nHost: Example.test\r\n\r\n", "Example.test"),
    (b"GET / HTTP/1.1\r\nhost:example.test:8080\r\nAccept: */*\r\n\r\n", "example.test"),
    (b"GET http://evil.test/ HTTP/1.1\r\nHost: example.test\r\n\r\n", "example.test"),
    (b"GET / HTTP/1.0\r\n\r\n", None),  # no Host
    (b"GET / HTTP/1.1\r\nHost: a.test\r\nHost: b.test\r\n\r\n", None),  # two
    (b"GET / HTTP/1.1\r\nHost: [::1]:80\r\n\r\n", None),
    (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", None),  # h2c prior knowledge
    (b"SSH-2.0-OpenSSH_9.6\r\n", None),
    (b"\x00\x01binary", None),
])
def test_http_host(head: bytes, host: str | None) -> None:
    assert requested_name(head) == host


def test_http_head_in_pieces_waits_for_its_end() -> None:
    with pytest.raises(NeedMore):
        requested_name(b"GET / HTTP/1.1\r\nHost: exa")


def _client_hello(name: str | None) -> bytes:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname=name)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


def test_tls_sni_from_a_real_client_hello() -> None:
    hello = _client_hello("api.example.test")
    assert requested_name(hello) == "api.example.test"
    assert requested_name(_client_hello(None)) is None  # no SNI (an IP-literal https)
    with pytest.raises(NeedMore):
        requested_name(hello[:len(hello) // 2])
    # The same handshake split over two records (a client may fragment it).
    body = hello[5:]
    half = len(body) // 2
    split = b"".join(hello[:3] + struct.pack("!H", len(part)) + part for part in (body[:half], body[half:]))
    assert requested_name(split) == "api.example.test"
    with pytest.raises(NeedMore):
        requested_name(split[:5 + half + 3])


@settings(max_examples=500)
@given(st.one_of(st.binary(max_size=300), st.binary(max_size=300).map(lambda b: b"\x16\x03\x01" + b),
                 st.binary(max_size=200).map(lambda b: _HELLO[:len(_HELLO) // 3] + b),
                 st.binary(max_size=100).map(lambda b: b"GET / HTTP/1.1\r\n" + b + b"\r\n\r\n")))
def test_any_first_bytes_name_a_host_or_none(data: bytes) -> None:
    try:
        name = requested_name(data)
    except NeedMore:
        return
    assert name is None or isinstance(name, str)


_HELLO = _client_hello("fuzz.example.test")
