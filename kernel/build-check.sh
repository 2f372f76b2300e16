#!/usr/bin/env bash
# Compile kernel/bunshin.c against Debian's 6.12 headers (bookworm's newer kernel line), so the
# version shims for 6.2-6.12 stay build errors rather than surprises on users' hosts, with warnings
# as errors (the guest build of `make test-guest GUEST_KERNEL=6.12` does not fail on warnings).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export DEBIAN_FRONTEND=noninteractive

newest() {
	apt-cache search --names-only '^linux-headers-6\.12\.[0-9]+\+deb12-amd64$' \
		| sed -nE 's/^linux-headers-(6\.12\.([0-9]+)\+deb12-amd64) .*/\2 \1/p' \
		| sort -n | tail -1 | cut -d' ' -f2
}

kver=${BUNSHIN_CHECK_KVER:-$(newest)}
if [ -z "$kver" ]; then
	apt-get update -q -o DPkg::Lock::Timeout=600 >/dev/null
	kver=$(newest)
fi
[ -n "$kver" ] || { echo "build-check: no linux-headers-6.12.*+deb12-amd64 in the archive" >&2; exit 1; }
if [ ! -d "/usr/src/linux-headers-$kver" ]; then
	apt-get install -y -q --no-install-recommends -o DPkg::Lock::Timeout=600 "linux-headers-$kver" >/dev/null
fi

work=$(mktemp -d /var/tmp/bunshin-build-check.XXXXXX)
trap 'rm -rf "$work"' EXIT
cp "$here/bunshin.c" "$here/bunshin_uapi.h" "$here/Makefile" "$work/"
log=$work/build.log
if ! make -C "/usr/src/linux-headers-$kver" M="$work" modules >"$log" 2>&1; then
	cat "$log" >&2
	echo "build-check: bunshin.c does not build against $kver" >&2
	exit 1
fi
# A warning (an implicit declaration, a pointer type mismatch) is a shim gone stale.
if grep -E "warning:|WARNING:" "$log" >&2; then
	echo "build-check: warnings building against $kver" >&2
	exit 1
fi
echo "build-check: bunshin.ko builds cleanly against $kver"
