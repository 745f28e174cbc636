#!/bin/bash
# usage: rootfs.sh DEB -> prints the path of a cached Debian 12 minbase root file system (.tar.zst)
# that has systemd, dbus, python3 and everything DEB depends on, so that DEB installs offline.
#
# The cache key is a hash of the package list, suite and mirror: a Depends change in debian/control
# builds a new one. Cache: $DS_OPS_E2E_CACHE (default /var/cache/ds-ops-e2e), outside the repo.
set -euo pipefail
DEB=$1
CACHE=${DS_OPS_E2E_CACHE:-/var/cache/ds-ops-e2e}
SUITE=bookworm
# The mirror this machine's apt uses (deb822 or one-line format); never a hard-coded other one.
MIRROR=$( { sed -n 's/^URIs:[[:space:]]*//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null
            sed -n 's/^deb[[:space:]]\+\(\[[^]]*\][[:space:]]\+\)\?\([^[:space:]]*\).*/\2/p' /etc/apt/sources.list 2>/dev/null
          } | grep -v -e security -e '^$' | head -n1 | awk '{print $1}' || true)
MIRROR=${MIRROR:-http://deb.debian.org/debian}

# Base system + the .deb's Depends (first alternative of each, version constraints dropped).
# man-db: systemd-analyze verify checks the unit's Documentation=man:ds-ops(1) with man(1).
deps=$(dpkg-deb -f "$DEB" Depends | tr ',' '\n' | sed 's/|.*//; s/(.*)//; s/:any//; s/[[:space:]]//g' | grep -v '^$')
PACKAGES=$(printf '%s\n' systemd systemd-sysv dbus python3 man-db $deps | sort -u | paste -sd, -)
KEY=$(printf '%s\n' "$SUITE" "$MIRROR" "$PACKAGES" | sha256sum | cut -c1-16)
TARBALL=$CACHE/rootfs-$KEY.tar.zst

mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9                                            # one builder at a time; the others then reuse it
if [ ! -s "$TARBALL" ]; then
    start=$(date +%s)
    work=$(mktemp -d "$CACHE/build.XXXXXX")
    trap 'rm -rf "$work"' EXIT
    echo "rootfs: debootstrap $SUITE from $MIRROR with $PACKAGES" >&2
    debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$work/root" "$MIRROR" >"$work/debootstrap.log" 2>&1 \
        || { tail -n 30 "$work/debootstrap.log" >&2; exit 1; }
    chroot "$work/root" apt-get clean
    rm -rf "$work"/root/var/lib/apt/lists/* "$work"/root/var/cache/apt/*.bin "$work"/root/var/log/*.log
    rm -f "$work/root/usr/sbin/policy-rc.d"        # a deny-all one would keep the unit from starting
    printf '%s\n' "$PACKAGES" >"$work/root/etc/ds-ops-e2e-packages"
    tar -C "$work/root" --numeric-owner --xattrs --acls -cf - . | zstd -q -T0 -10 >"$TARBALL.tmp"
    mv "$TARBALL.tmp" "$TARBALL"
    # one package list is in use at a time: drop the root file systems of earlier ones
    find "$CACHE" -maxdepth 1 -name 'rootfs-*.tar.zst' ! -name "${TARBALL##*/}" -delete
    echo "rootfs: built $TARBALL in $(( $(date +%s) - start )) s, $(du -h "$TARBALL" | cut -f1)" >&2
fi
echo "$TARBALL"
