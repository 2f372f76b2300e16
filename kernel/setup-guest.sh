#!/usr/bin/env bash
# Idempotent set-up of the guest-kernel test harness (`make test-guest`, see
# kernel/README.md): qemu, busybox, Debian's newest bookworm kernel of one line
# (6.1, or 6.12) with its headers, an uncompressed vmlinux for qemu's PVH boot, a
# busybox initramfs and bunshin.ko built for that kernel, all under
# /var/cache/bunshin/guest/KVER.  Prints nothing but progress on stderr.
#
# Environment:
#   BUNSHIN_GUEST_LINE   kernel line: 6.1 (default; Debian 12's own) or 6.12
#   BUNSHIN_GUEST_KVER   use this exact version instead of the line's newest
#   BUNSHIN_CACHE        cache root (default /var/cache/bunshin)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cache=${BUNSHIN_CACHE:-/var/cache/bunshin}/guest

log() { printf '[setup-guest] %s\n' "$*" >&2; }

[ "$(id -u)" = 0 ] || { echo "setup-guest.sh must run as root (apt, mknod)" >&2; exit 1; }
line=${BUNSHIN_GUEST_LINE:-6.1}
case "$line" in
6.1) image_re='^linux-image-6\.1\.0-[0-9]+-amd64$' ;;
6.12) image_re='^linux-image-6\.12\.[0-9]+\+deb12-amd64$' ;;
*) echo "BUNSHIN_GUEST_LINE=$line: use 6.1 or 6.12" >&2; exit 1 ;;
esac
mkdir -p "$cache"

export DEBIAN_FRONTEND=noninteractive
# Other set-up steps may be running apt at the same time; wait for them.
apt_opts=(-y -q --no-install-recommends -o DPkg::Lock::Timeout=600)

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }

newest_kver() {
	apt-cache search --names-only "$image_re" | cut -d' ' -f1 | sed 's/^linux-image-//' | sort -V | tail -1
}

updated=
apt_update() {
	[ -n "$updated" ] && return
	log "apt-get update"
	apt-get update -q -o DPkg::Lock::Timeout=600 >/dev/null
	updated=1
}

kver=${BUNSHIN_GUEST_KVER:-}
if [ -z "$kver" ]; then
	kver=$(newest_kver)
	# A fresh machine has no package lists yet.
	[ -n "$kver" ] || { apt_update; kver=$(newest_kver); }
	[ -n "$kver" ] || { echo "no $image_re in the bookworm archive" >&2; exit 1; }
fi

packages=(qemu-system-x86 busybox-static cpio xz-utils zstd kmod build-essential python3
	"linux-image-$kver" "linux-headers-$kver")
missing=()
for p in "${packages[@]}"; do installed "$p" || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
	apt_update
	log "apt: installing ${missing[*]}"
	# The host boots its own kernel, never this one, so skip the initramfs that
	# the image's postinst hook would spend a minute building for it: the hook
	# honours INITRD=No, and without a first initrd the initramfs-tools trigger
	# has nothing to update either.  Without grub no bootloader hook runs.
	INITRD=No apt-get install "${apt_opts[@]}" "${missing[@]}" >"$cache/apt.log" 2>&1 \
		|| { tail -30 "$cache/apt.log" >&2; exit 1; }
fi
[ -f "/boot/vmlinuz-$kver" ] || { echo "/boot/vmlinuz-$kver missing after install" >&2; exit 1; }
[ -d "/usr/src/linux-headers-$kver" ] || { echo "/usr/src/linux-headers-$kver missing" >&2; exit 1; }

# qemu -kernel boots an ELF vmlinux through its PVH note, far faster under TCG
# than the bzImage's real-mode setup; vmlinux.py extracts it and checks the note.
kcache=$cache/$kver
mkdir -p "$kcache"
vmlinux=$kcache/vmlinux
if [ ! -s "$vmlinux" ] || [ "/boot/vmlinuz-$kver" -nt "$vmlinux" ]; then
	log "extracting $vmlinux"
	python3 "$here/vmlinux.py" extract "/boot/vmlinuz-$kver" "$vmlinux" >&2
else
	python3 "$here/vmlinux.py" check-pvh "$vmlinux" >/dev/null
fi

# --- initramfs ---------------------------------------------------------------
modules=(netfs fscache 9pnet 9pnet_virtio 9p virtio_pci virtio_pci_modern_dev
	virtio_pci_legacy_dev virtio_ring virtio overlay)
moddir=/lib/modules/$kver
initramfs=$kcache/initramfs.cpio.gz
stamp=$(cat "$here/guest-init.sh" "$0" /bin/busybox "$moddir/modules.dep" | sha256sum | cut -d' ' -f1)
stamp="$kver $stamp"

if [ -s "$initramfs" ] && [ "$(cat "$kcache/initramfs.stamp" 2>/dev/null)" = "$stamp" ]; then
	:
else
	log "building $initramfs"
	stage=$(mktemp -d)
	trap 'rm -rf "$stage"' EXIT
	mkdir -p "$stage"/{bin,dev,proc,sys,lower,rw,newroot,out,modules,tmp}
	cp /bin/busybox "$stage/bin/busybox"
	install -m 755 "$here/guest-init.sh" "$stage/init"
	# The kernel opens /dev/console before /init can mount devtmpfs.
	mknod -m 600 "$stage/dev/console" c 5 1

	declare -A seen=()
	order=()
	add_module() { # $1: path relative to $moddir, as in modules.dep
		local rel=$1 dep
		[ -n "${seen[$rel]:-}" ] && return
		seen[$rel]=1
		# shellcheck disable=SC2013  # modules.dep lists deps space-separated on one line
		for dep in $(awk -F': *' -v m="$rel" '$1 == m { print $2 }' "$moddir/modules.dep"); do
			add_module "$dep"
		done
		order+=("$rel")
	}
	for m in "${modules[@]}"; do
		rel=$(grep -oE "^[^:]*/$m\.ko(\.xz|\.zst|\.gz)?:" "$moddir/modules.dep" | head -1 | tr -d :) || true
		if [ -n "$rel" ]; then
			add_module "$rel"
		elif grep -qE "/$m\.ko$" "$moddir/modules.builtin"; then
			: # built in, nothing to load
		elif [ "$m" = fscache ]; then
			: # 6.4 merged fscache into netfs
		else
			echo "module $m neither in modules.dep nor built into $kver" >&2
			exit 1
		fi
	done
	i=10
	for rel in "${order[@]}"; do
		base=$(basename "$rel")
		dest="$stage/modules/$i-${base%%.ko*}.ko"
		case "$rel" in
		*.ko.xz) xz -dc "$moddir/$rel" >"$dest" ;;
		*.ko.zst) zstd -dcq "$moddir/$rel" >"$dest" ;;
		*.ko.gz) gzip -dc "$moddir/$rel" >"$dest" ;;
		*) cp "$moddir/$rel" "$dest" ;;
		esac
		i=$((i + 1))
	done
	log "initramfs modules: ${order[*]##*/}"
	(cd "$stage" && find . -print0 | LC_ALL=C sort -z \
		| cpio --null -o -H newc --quiet -R 0:0) | gzip -6 >"$initramfs.tmp"
	mv "$initramfs.tmp" "$initramfs"
	echo "$stamp" >"$kcache/initramfs.stamp"
fi

# --- the module, built for this kernel ---------------------------------------
# Outside the source tree: a bunshin.ko built for one guest kernel must never be
# loaded into the other.  Copied only when changed, so make rebuilds only then.
mod=$kcache/module
mkdir -p "$mod"
for f in bunshin.c bunshin_uapi.h Makefile; do
	cmp -s "$here/$f" "$mod/$f" || cp "$here/$f" "$mod/$f"
done
make -s -C "$mod" KDIR="/usr/src/linux-headers-$kver" >"$mod/build.log" 2>&1 \
	|| { cat "$mod/build.log" >&2; echo "bunshin.ko does not build against $kver" >&2; exit 1; }

# guest.py and the Makefile find the line's kernel through this file.
echo "$kver" >"$cache/line-$line.tmp" && mv "$cache/line-$line.tmp" "$cache/line-$line"
log "guest ready: kernel $kver, $vmlinux, $initramfs, $mod/bunshin.ko"
