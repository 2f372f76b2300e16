"""Egress policies as data: E2B's network rules parsed, normalised and refused (no host state)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bunshinfork.errors import SpecError
from bunshinfork.network.egress import ALL_TRAFFIC, CLOSED, EgressPolicy, from_e2b, parse
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
    {"deny_out": ["example.com"]}, {"allow_out": ["example.com"]}, {"allow_out": ["10.0.0.0/33"]},
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
