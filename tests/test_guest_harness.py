"""The guest-kernel harness (kernel/guest.py) itself, run from the host.

Each boot is a few seconds of TCG emulation, so the checks share boots: one
probe run answers most of them.  Skipped until kernel/setup-guest.sh has built
the guest (`make test-guest` runs it).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from helpers import load_by_path

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def _load_guest() -> ModuleType:
    # kernel/ is a kbuild directory, not a Python package.
    return load_by_path("bunshin_guest", "kernel/guest.py", register=True)


# Loaded from a path, so its types are invisible to a type checker: fixtures
# holding GuestResult objects are typed Any.
guest = _load_guest()

HELLO_C = textwrap.dedent(
    """\
    #include <linux/init.h>
    #include <linux/module.h>

    static int __init bunshin_hello_init(void)
    {
    \tpr_info("bunshin_hello: loaded\\n");
    \treturn 0;
    }

    static void __exit bunshin_hello_exit(void)
    {
    \tpr_info("bunshin_hello: unloaded\\n");
    }

    module_init(bunshin_hello_init);
    module_exit(bunshin_hello_exit);
    MODULE_LICENSE("GPL");
    """
)


@pytest.fixture(scope="module")
def image() -> Any:
    try:
        return guest.guest_image()
    except guest.GuestSetupError as e:
        pytest.skip(f"guest not set up ({e}); run kernel/setup-guest.sh or make test-guest")


@pytest.fixture(scope="module")
def shared_dir() -> Iterator[Path]:
    # Not under /tmp: the guest mounts a fresh tmpfs there, hiding the host's.
    d = Path(tempfile.mkdtemp(prefix="bunshin-guest-test-", dir="/var/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def hello_ko(image: Any, shared_dir: Path) -> Path:
    src = shared_dir / "hello"
    src.mkdir()
    (src / "bunshin_hello.c").write_text(HELLO_C)
    (src / "Kbuild").write_text("obj-m := bunshin_hello.o\n")
    proc = subprocess.run(
        ["make", "-C", str(guest.headers_dir()), f"M={src}", "modules"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return src / "bunshin_hello.ko"


@pytest.fixture(scope="module")
def probe(image: Any, shared_dir: Path, hello_ko: Path) -> Any:
    marker = shared_dir / "from-host.txt"
    marker.write_text("written by the host\n")
    script = f"""
        echo "== uname"; uname -r
        echo "== marker"; cat {marker}
        echo "== ksm"; ls /sys/kernel/mm/ksm/run && echo present
        echo "== insmod"; insmod {hello_ko} && echo loaded
        echo "== modules"; cat /proc/modules
        echo "== done"
    """
    return guest.run_in_guest(textwrap.dedent(script), timeout=300)


def section(output: str, name: str) -> str:
    m = re.search(rf"^== {name}\n(.*?)(?=^== |\Z)", output, re.S | re.M)
    assert m, f"section {name!r} missing from guest output:\n{output}"
    return m.group(1)


def test_command_runs(probe: Any) -> None:
    assert probe.exit_code == 0, probe.console
    assert "== done" in probe.output
    assert probe.boot_seconds is not None


def test_guest_runs_debian_61_kernel(probe: Any) -> None:
    assert re.fullmatch(r"6\.1\.0-\d+-amd64\n", section(probe.output, "uname"))


def test_host_file_visible(probe: Any) -> None:
    assert section(probe.output, "marker") == "written by the host\n"


def test_ksm_available(probe: Any) -> None:
    assert "present" in section(probe.output, "ksm")


def test_insmod_out_of_tree_module(probe: Any) -> None:
    assert "loaded" in section(probe.output, "insmod"), probe.output
    assert re.search(r"^bunshin_hello ", section(probe.output, "modules"), re.M)
    assert "bunshin_hello: loaded" in probe.dmesg


def test_dmesg_clean(probe: Any) -> None:
    assert "Linux version 6.1.0" in probe.dmesg
    assert guest.kernel_splats(probe.dmesg) == [], probe.dmesg


@pytest.mark.parametrize("line", ["6.1", "6.12"])
def test_module_built_for_each_kernel_line_loads(line: str) -> None:
    """setup-guest.sh builds bunshin.ko per guest kernel; each line boots and loads its own."""
    try:
        image = guest.guest_image(line)
    except guest.GuestSetupError as e:
        pytest.skip(f"guest line {line} not set up ({e})")
    result = guest.run_in_guest("uname -r; insmod $BUNSHIN_GUEST_MODULE && ls /dev/bunshin", timeout=300, kernel=line)
    assert result.exit_code == 0, result.console
    assert result.output == f"{image.kver}\n/dev/bunshin\n"
    assert "bunshin: /dev/bunshin ready" in result.dmesg
    assert guest.kernel_splats(result.dmesg) == [], result.dmesg


def test_exit_code_propagates_long_command(image: Any) -> None:
    # Long enough to travel through the out share rather than the kernel command line.
    filler = "# " + "x" * (2 * guest.MAX_CMDLINE_SCRIPT) + "\n"
    result = guest.run_in_guest(filler + "echo before; exit 3\n", timeout=300)
    assert result.exit_code == 3, result.console
    assert result.output == "before\n"
    assert not result.timed_out


def test_timeout_kills_qemu(image: Any, shared_dir: Path) -> None:
    out = shared_dir / "timeout-out"
    start = time.monotonic()
    result = guest.run_in_guest("sleep 600", timeout=12, out_dir=out)
    assert result.timed_out
    assert result.exit_code == -1
    assert time.monotonic() - start < 60
    # qemu's command line names the out share, so this finds only our own qemu.
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    assert str(out) not in ps
