#!/usr/bin/env python3
"""Run a shell command inside a Debian guest kernel (6.1, or 6.12) under qemu (TCG).

The host cannot load kernel modules, so module work is tested in a throw-away
guest: qemu boots the vmlinux and busybox initramfs that kernel/setup-guest.sh
caches under /var/cache/bunshin/guest, the guest mounts the host root read-only
over virtio-9p under a tmpfs overlay, runs the command there as root and reports
back through a second, writable 9p share.  See kernel/README.md.

    python kernel/guest.py [--kernel 6.1|6.12] [--timeout N] [--mem MiB] [--smp N] -- CMD...

A single CMD argument is a shell script (``-- 'insmod x.ko && dmesg'``); several
are quoted and joined like a command line (``-- uname -r``).  The exit status is
the command's, 124 on timeout and 125 when the guest never ran it; with
--check-dmesg a clean exit becomes 1 when the kernel logged a BUG or WARNING.
The command finds bunshin.ko built for the guest's kernel in $BUNSHIN_GUEST_MODULE.
"""

from __future__ import annotations

import argparse
import base64
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

EXIT_TIMEOUT = 124
EXIT_NO_STATUS = 125
# The x86 kernel command line holds 2048 bytes; longer commands go through the
# out share instead, which needs no size limit.
MAX_CMDLINE_SCRIPT = 1024
QEMU_DATA = "/usr/share/qemu"
DEFAULT_LINE = "6.1"  # Debian 12's own kernel; 6.12 is its newer line (PR_SET_MEMORY_MERGE, per-VMA locks)
# How qemu runs the vCPUs. Under multi-threaded TCG, 6.12 oopsed on an int3 left by a static
# key's text_poke_bp (perf_sched_events, in __schedule), which a vCPU still ran after the
# patch was complete: cross-vCPU code modification that one TCG thread cannot get wrong.
TCG_THREAD = {"6.1": "multi", "6.12": "single"}
# TCG's emulated TSCs look unsynchronised to the kernel, which then falls back to
# HPET: an emulated MMIO read on every clock_gettime.  Spectre/Meltdown
# mitigations only cost emulation time in a throw-away test guest.
# watchdog_thresh=60: the soft-lockup detector fires after 2x this many seconds of a CPU that
# does not schedule. Under TCG a vCPU can be starved by the emulator for longer than the default
# 20 s: a 6.12 run flagged "BUG: soft lockup" in clear_page_erms while a 2 MiB huge page was
# zeroed for a page fault of the test's own python, nothing of the module on the stack. At 120 s
# it still reports a real lockup, and every test has its own, shorter deadline for a hang.
KERNEL_ARGS = ("console=ttyS0", "panic=-1", "tsc=reliable", "mitigations=off", "watchdog_thresh=60")


# A kernel splat's first line, after the printk timestamp.
SPLAT = re.compile(
    r"^(?:\[[ \d.]+\] )?(?:BUG:|WARNING:|Oops|Kernel panic|general protection fault|"
    r"kernel BUG at|Unable to handle kernel|INFO: task .* blocked)",
    re.M,
)


def kernel_splats(dmesg: str) -> list[str]:
    """Lines of ``dmesg`` that start a BUG, WARNING, oops, panic or hung-task report."""
    return [m.group(0) + dmesg[m.end() :].split("\n", 1)[0] for m in SPLAT.finditer(dmesg)]


class GuestSetupError(RuntimeError):
    """The cached guest kernel or initramfs is missing: run kernel/setup-guest.sh."""


@dataclass
class GuestResult:
    exit_code: int
    """The command's exit status, or -1 when the guest never reported one."""
    output: str
    """The command's stdout and stderr, interleaved, without kernel messages."""
    dmesg: str
    """The guest's kernel log after the command, or the console when none came back."""
    console: str = ""
    timed_out: bool = False
    boot_seconds: float | None = None
    """Guest uptime when the command started."""
    wall_seconds: float = 0.0
    """Host time from qemu's start to its exit."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


@dataclass
class GuestImage:
    kver: str
    vmlinux: Path
    initramfs: Path
    module: Path
    """bunshin.ko built for this kernel."""


def cache_dir() -> Path:
    return Path(os.environ.get("BUNSHIN_CACHE", "/var/cache/bunshin")) / "guest"


def guest_image(line: str = DEFAULT_LINE) -> GuestImage:
    """Locate what setup-guest.sh built for a kernel line; raise GuestSetupError when it has not run."""
    cache = cache_dir()
    setup = f"run BUNSHIN_GUEST_LINE={line} kernel/setup-guest.sh"
    try:
        kver = (cache / f"line-{line}").read_text().strip()
    except FileNotFoundError:
        raise GuestSetupError(f"{cache}/line-{line} missing: {setup}") from None
    kcache = cache / kver
    image = GuestImage(kver, kcache / "vmlinux", kcache / "initramfs.cpio.gz", kcache / "module" / "bunshin.ko")
    for path in (image.vmlinux, image.initramfs, image.module):
        if not path.is_file():
            raise GuestSetupError(f"{path} missing: {setup}")
    if shutil.which("qemu-system-x86_64") is None:
        raise GuestSetupError("qemu-system-x86_64 missing: run kernel/setup-guest.sh")
    return image


def headers_dir(line: str = DEFAULT_LINE) -> Path:
    """The kbuild tree to build guest modules against (KDIR)."""
    return Path("/usr/src") / f"linux-headers-{guest_image(line).kver}"


def qemu_command(image: GuestImage, out_dir: Path, append: str, mem_mib: int, smp: int,
                 tcg_thread: str = "multi") -> list[str]:
    # qboot jumps straight to the PVH entry and, unlike SeaBIOS, prints nothing
    # (no escape sequences in front of the console output).
    firmware = ["-bios", "qboot.rom"] if Path(QEMU_DATA, "qboot.rom").is_file() else []
    return [
        "qemu-system-x86_64",
        "-accel", f"tcg,thread={tcg_thread}",
        "-cpu", "max",
        "-m", str(mem_mib),
        "-smp", str(smp),
        # No default NIC, VGA or monitor: nothing in the guest uses them and the
        # console must carry nothing but the serial port.
        "-nodefaults",
        "-nographic",
        "-serial", "stdio",
        "-no-reboot",
        *firmware,
        "-kernel", str(image.vmlinux),
        "-initrd", str(image.initramfs),
        "-append", append,
        # multidevs=remap keeps inode numbers unique across the host's mounts,
        # which the guest's overlayfs relies on.
        "-fsdev", "local,id=root,path=/,security_model=passthrough,readonly=on,multidevs=remap",
        "-device", "virtio-9p-pci,fsdev=root,mount_tag=hostroot",
        "-fsdev", f"local,id=out,path={out_dir},security_model=passthrough",
        "-device", "virtio-9p-pci,fsdev=out,mount_tag=out",
    ]  # fmt: skip


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return None


def _pump(stream: TextIO, sink: list[str], echo: TextIO | None) -> None:
    for line in stream:
        line = line.replace("\r\n", "\n")
        sink.append(line)
        if echo is not None:
            echo.write(line)
            echo.flush()


def run_in_guest(
    cmd: str,
    timeout: int = 600,
    mem_mib: int = 4096,
    smp: int = 2,
    *,
    cwd: str | os.PathLike[str] | None = None,
    echo: TextIO | None = None,
    verbose: bool = False,
    out_dir: str | os.PathLike[str] | None = None,
    extra_append: Sequence[str] = (),
    extra_qemu: Sequence[str] = (),
    kernel: str = DEFAULT_LINE,
    tcg_thread: str | None = None,
) -> GuestResult:
    """Boot the guest, run ``/bin/sh -c cmd`` in it as root and power it off.

    ``cwd`` is a host path (the guest sees the host's tree; default: the current
    directory).  ``echo`` receives the serial console line by line as it arrives;
    ``verbose`` puts the kernel's boot messages on it too.  ``out_dir`` keeps the
    out share (output, dmesg, status, and anything the command writes to
    $BUNSHIN_GUEST_OUT) instead of a temporary directory.  qemu is killed when
    ``timeout`` seconds pass, whatever state the guest is in.  ``extra_append``
    and ``extra_qemu`` add kernel parameters and qemu arguments.  ``kernel`` picks
    the kernel line; ``tcg_thread`` ("multi" or "single") overrides its TCG_THREAD.
    """
    image = guest_image(kernel)
    cmd = f"export BUNSHIN_GUEST_MODULE={shlex.quote(str(image.module))}\n{cmd}"
    keep = out_dir is not None
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="bunshin-guest-"))
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("status", "output", "dmesg", "boot_seconds", "end_seconds", "cmd.sh"):
        (out / stale).unlink(missing_ok=True)
    try:
        workdir = os.fspath(cwd) if cwd is not None else os.getcwd()
        append = [
            *KERNEL_ARGS,
            "loglevel=7" if verbose else "quiet",
            "bunshin_guest.cwd=" + base64.b64encode(workdir.encode()).decode(),
        ]
        append += extra_append
        script = base64.b64encode(cmd.encode()).decode()
        if len(script) <= MAX_CMDLINE_SCRIPT:
            append.append("bunshin_guest.cmd=" + script)
        else:
            (out / "cmd.sh").write_text(cmd)
        thread = tcg_thread or TCG_THREAD[kernel]
        argv = qemu_command(image, out, " ".join(append), mem_mib, smp, thread) + list(extra_qemu)

        console: list[str] = []
        start = time.monotonic()
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        assert proc.stdout is not None
        reader = threading.Thread(target=_pump, args=(proc.stdout, console, echo), daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            # Also reached on KeyboardInterrupt: never leave a qemu spinning a core.
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        wall = time.monotonic() - start
        reader.join(timeout=5)

        console_text = "".join(console)
        status = _read_text(out / "status")
        exit_code = int(status) if status and status.strip().lstrip("-").isdigit() else -1
        boot = _read_text(out / "boot_seconds")
        dmesg = _read_text(out / "dmesg")
        return GuestResult(
            exit_code=exit_code,
            output=_read_text(out / "output") or "",
            dmesg=dmesg if dmesg is not None else console_text,
            console=console_text,
            timed_out=timed_out,
            boot_seconds=float(boot) if boot else None,
            wall_seconds=wall,
        )
    finally:
        if not keep:
            shutil.rmtree(out, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kernel/guest.py",
        description="Run a command as root in a qemu guest with a Debian kernel (6.1 or 6.12).",
    )
    parser.add_argument("--kernel", default=DEFAULT_LINE, choices=tuple(TCG_THREAD), help="guest kernel line")
    parser.add_argument("--tcg-thread", choices=("multi", "single"), help="override the line's TCG threading")
    parser.add_argument("--timeout", type=int, default=600, help="seconds before qemu is killed")
    parser.add_argument("--mem", type=int, default=4096, metavar="MiB", help="guest memory")
    parser.add_argument("--smp", type=int, default=2, help="guest CPUs")
    parser.add_argument("--cwd", help="working directory in the guest (default: the current one)")
    parser.add_argument("--out", help="keep the out share (output, dmesg, status) in this directory")
    parser.add_argument("--dmesg", action="store_true", help="print the guest's dmesg at the end")
    parser.add_argument(
        "--check-dmesg",
        action="store_true",
        help="fail (exit 1) when the command succeeded but the kernel logged a BUG/WARNING/oops",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="show the kernel boot log")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD...")
    args = parser.parse_args(argv)

    cmd_args = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd_args:
        parser.error("no command given (use: -- CMD...)")
    cmd = cmd_args[0] if len(cmd_args) == 1 else shlex.join(cmd_args)

    try:
        result = run_in_guest(
            cmd,
            timeout=args.timeout,
            mem_mib=args.mem,
            smp=args.smp,
            cwd=args.cwd,
            echo=sys.stdout,
            verbose=args.verbose,
            out_dir=args.out,
            kernel=args.kernel,
            tcg_thread=args.tcg_thread,
        )
    except GuestSetupError as e:
        print(f"guest.py: {e}", file=sys.stderr)
        return EXIT_NO_STATUS
    if args.dmesg:
        print("----- guest dmesg -----")
        print(result.dmesg, end="")
    boot = f"{result.boot_seconds:.1f}s" if result.boot_seconds is not None else "n/a"
    print(
        f"guest.py: exit {result.exit_code}, boot {boot}, wall {result.wall_seconds:.1f}s",
        file=sys.stderr,
    )
    if result.timed_out:
        print(f"guest.py: timed out after {args.timeout}s, qemu killed", file=sys.stderr)
        return EXIT_TIMEOUT
    if result.exit_code < 0:
        print("guest.py: the guest never reported an exit status", file=sys.stderr)
        return EXIT_NO_STATUS
    splats = kernel_splats(result.dmesg)
    if splats:
        print("guest.py: the kernel logged:\n  " + "\n  ".join(splats), file=sys.stderr)
        if args.check_dmesg and result.exit_code == 0:
            return 1
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
