"""bunshinfork.host: one typed configuration of which host a process is, with the old defaults."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bunshinfork import state
from bunshinfork.cgroups import cgroup
from bunshinfork.fs import store
from bunshinfork.host import HOST, HostConfig
from bunshinfork.network import bridge


def test_defaults_are_one_host_per_machine() -> None:
    d = HostConfig.from_env({})
    assert (str(d.run_root), d.cgroup_parent, d.bridge, d.subnet, str(d.layer_store)) == (
        "/run/bunshin", "bunshin", "bunshin0", "10.213.0.0/16", "/var/lib/bunshin/layers")


def test_every_module_reads_this_process_host() -> None:
    seen = (state.RUN_ROOT, cgroup.PARENT, bridge.BRIDGE, store.STORE)
    assert seen == (HOST.run_root, HOST.cgroup_parent, HOST.bridge, HOST.layer_store)


def test_named_hosts_do_not_clash_and_travel_by_environment() -> None:
    a, b = HostConfig.named("a"), HostConfig.named("b")
    for field in ("run_root", "cgroup_parent", "bridge", "layer_store"):
        assert getattr(a, field) != getattr(b, field) != getattr(HostConfig(), field)
    assert HostConfig.from_env(a.env()) == a
    code = "from bunshinfork import state; from bunshinfork.cgroups import cgroup; " \
           "from bunshinfork.network import bridge; print(state.RUN_ROOT, cgroup.PARENT, bridge.BRIDGE)"
    out = subprocess.run([sys.executable, "-c", code], env=a.env(), capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(a.run_root), a.cgroup_parent, a.bridge]


@pytest.mark.parametrize("bad", ["", "A", "toolongname", "a/b", "-a"])
def test_bad_host_names_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        HostConfig.named(bad)
