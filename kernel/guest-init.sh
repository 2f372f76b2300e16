#!/bin/busybox sh
# shellcheck shell=dash disable=SC2013,SC2016  # busybox ash: like dash, plus pipefail
# /init of the bunshin test guest (see kernel/README.md).  Runs under the static
# busybox in the initramfs: boots the host root read-only over virtio-9p under a
# tmpfs overlay, switch_roots into it to run one command, writes the results to the
# "out" 9p share and powers off.

/bin/busybox mkdir -p /sbin /usr/bin /usr/sbin
/bin/busybox --install -s
export PATH=/bin:/sbin:/usr/bin:/usr/sbin

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
exec </dev/null >/dev/console 2>&1

# Power off at once on a broken boot so the host need not wait out its timeout;
# the host reports the console tail since no status file was written.
die() {
	echo "bunshin-guest: $*"
	poweroff -f
}

cmd_b64='' cwd=/ quiet=''
for arg in $(cat /proc/cmdline); do
	case "$arg" in
	bunshin_guest.cmd=*) cmd_b64=${arg#*=} ;;
	bunshin_guest.cwd=*) cwd=$(echo "${arg#*=}" | base64 -d) ;;
	bunshin_guest.quiet=1) quiet=1 ;;
	esac
done

# Modules were copied in dependency order; some may already be built in.
for ko in /modules/*.ko; do
	[ -e "$ko" ] || continue
	out=$(insmod "$ko" 2>&1) || case "$out" in
		*exists*) ;;
		*) echo "bunshin-guest: insmod $ko: $out" ;;
		esac
done

# virtio devices probe asynchronously from the module load; retry briefly.
mount_9p() {
	tag=$1 dir=$2 opts=$3
	mkdir -p "$dir"
	i=0
	until mount -t 9p -o "trans=virtio,version=9p2000.L,msize=512000,$opts" "$tag" "$dir" 2>/dev/null; do
		i=$((i + 1))
		[ $i -gt 50 ] && return 1
		sleep 0.1
	done
}

mount_9p out /out "cache=none" || die "cannot mount the out share"
# The host root is read-only for the whole run, so the guest may cache it freely;
# without cache=loose every python import is a round trip through TCG.
mount_9p hostroot /lower "ro,cache=loose" || die "cannot mount the host root"

mount -t tmpfs -o mode=755 rw /rw
mkdir -p /rw/upper /rw/work /newroot
mount -t overlay overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work /newroot \
	|| die "cannot mount the overlay root"

r=/newroot
mount -t proc proc $r/proc
mount -t sysfs sysfs $r/sys
mount -t devtmpfs devtmpfs $r/dev
mkdir -p $r/dev/pts $r/dev/shm $r/dev/mqueue
mount -t devpts -o newinstance,ptmxmode=0666,mode=620 devpts $r/dev/pts
mount -t tmpfs -o mode=1777 shm $r/dev/shm
mount -t mqueue mqueue $r/dev/mqueue 2>/dev/null
# A fresh /tmp, unless the command's directory lives there (a CI checkout under /tmp must
# stay visible through the overlay).
case "$cwd" in
/tmp | /tmp/*) ;;
*) mount -t tmpfs -o mode=1777 tmp $r/tmp ;;
esac
mount -t tmpfs -o mode=755 run $r/run
mount -t cgroup2 -o nsdelegate cgroup2 $r/sys/fs/cgroup 2>/dev/null \
	|| mount -t cgroup2 cgroup2 $r/sys/fs/cgroup
mount -t debugfs debugfs $r/sys/kernel/debug 2>/dev/null
mount -t tracefs tracefs $r/sys/kernel/tracing 2>/dev/null
mount -t securityfs securityfs $r/sys/kernel/security 2>/dev/null
mount -t bpf bpf $r/sys/fs/bpf 2>/dev/null
# Lets a command leave artefacts for the host next to its output.
mkdir -p $r/run/bunshin-guest/out
mount --bind /out $r/run/bunshin-guest/out
[ -e /proc/sys/kernel/hostname ] && echo bunshin-guest >/proc/sys/kernel/hostname
ip link set lo up 2>/dev/null

if [ -n "$cmd_b64" ]; then
	echo "$cmd_b64" | base64 -d >$r/run/bunshin-guest/cmd.sh
elif [ -f /out/cmd.sh ]; then
	cp /out/cmd.sh $r/run/bunshin-guest/cmd.sh
else
	die "no command (bunshin_guest.cmd= or cmd.sh in the out share)"
fi

# What CRIU needs and Debian builds as modules: socket diagnostics (dumping sockets),
# veth and tun (kerndat probes), nf_tables (--network-lock nftables).
chroot $r /sbin/modprobe -a unix_diag inet_diag tcp_diag udp_diag netlink_diag af_packet_diag \
	raw_diag veth tun nf_tables nft_ct 2>/dev/null || true

cut -d' ' -f1 /proc/uptime >/out/boot_seconds
[ -n "$quiet" ] || echo "bunshin-guest: running command (uptime $(cut -d' ' -f1 /proc/uptime)s)"

# Stage 2 runs as PID 1 inside the new root. switch_root, not chroot: CRIU refuses a task
# whose root differs from its mount namespace's root ("another root than mntns").
g=/run/bunshin-guest
cp /bin/busybox $r$g/busybox
cat >$r$g/stage2.sh <<STAGE2
set -o pipefail
# tee keeps the console live for the CLI while the out share gets a copy that
# kernel messages cannot interleave with.
/usr/bin/env -i \
	PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
	HOME=/root TERM=dumb LANG=C.UTF-8 BUNSHIN_GUEST=1 \
	BUNSHIN_GUEST_OUT=$g/out \
	/bin/sh -c 'cd "\$1" 2>/dev/null || { echo "bunshin-guest: no \$1 in the guest (under /tmp?), running in /"; cd /; }
		exec /bin/sh $g/cmd.sh </dev/null' sh "$cwd" 2>&1 \
	| $g/busybox tee $g/out/output
rc=\$?
set +o pipefail
$g/busybox cut -d' ' -f1 /proc/uptime >$g/out/end_seconds
$g/busybox dmesg >$g/out/dmesg
echo "\$rc" >$g/out/status
$g/busybox sync
$g/busybox poweroff -f
STAGE2
exec switch_root $r $g/busybox sh $g/stage2.sh
