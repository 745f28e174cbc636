#!/bin/bash
# usage: rootfs.sh DEB -> prints the path of a cached Debian 12 minbase root file system (.tar.zst)
# that has systemd, dbus, python3 and everything DEB depends on, so that DEB installs offline.
# It also holds, not installed, the .debs of the test tools (TOOLS: Debian's Prometheus, its node
# exporter, acl for docs/INSTALL.md's setfacl) and what they need beyond that system, in TOOLS_DIR,
# so that a test installs them offline with apt beside DEB (tests/e2e/test_alerts_e2e.py).
#
# The cache key is a hash of the package list, the tool list, suite, mirror and this script: a
# Depends change in debian/control, a tool added or a step changed here builds a new one. Cache:
# $DS_OPS_E2E_CACHE (default /var/cache/ds-ops-e2e), outside the repo.
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
TOOLS="prometheus prometheus-node-exporter acl"
TOOLS_DIR=/var/local/ds-ops-e2e-tools          # inside the root file system
KEY=$( { printf '%s\n' "$SUITE" "$MIRROR" "$PACKAGES" "tools: $TOOLS"; cat "$0"; } | sha256sum | cut -c1-16)
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
    # the tools' .debs, resolved against this system by its own apt (debootstrap left the lists);
    # the archive emptied of debootstrap's own .debs first
    chroot "$work/root" apt-get clean
    tools_start=$(date +%s)
    chroot "$work/root" apt-get install -q -y --download-only --no-install-recommends \
        -o Acquire::Check-Valid-Until=false $TOOLS >"$work/tools.log" 2>&1 || { tail -n 30 "$work/tools.log" >&2; exit 1; }
    mkdir -p "$work/root$TOOLS_DIR"
    mv "$work"/root/var/cache/apt/archives/*.deb "$work/root$TOOLS_DIR/"
    echo "rootfs: $TOOLS_DIR: $(ls "$work/root$TOOLS_DIR" | wc -l) .debs, $(du -sh "$work/root$TOOLS_DIR" | cut -f1)," \
         "downloaded in $(( $(date +%s) - tools_start )) s" >&2
    rm -rf "$work"/root/var/lib/apt/lists/* "$work"/root/var/cache/apt/*.bin "$work"/root/var/log/*.log
    rm -f "$work/root/usr/sbin/policy-rc.d"        # a deny-all one would keep the unit from starting
    printf '%s\n' "$PACKAGES" "tools: $TOOLS" >"$work/root/etc/ds-ops-e2e-packages"
    tar -C "$work/root" --numeric-owner --xattrs --acls -cf - . | zstd -q -T0 -10 >"$TARBALL.tmp"
    mv "$TARBALL.tmp" "$TARBALL"
    # one package list is in use at a time: drop the root file systems of earlier ones
    find "$CACHE" -maxdepth 1 -name 'rootfs-*.tar.zst' ! -name "${TARBALL##*/}" -delete
    echo "rootfs: built $TARBALL in $(( $(date +%s) - start )) s, $(du -h "$TARBALL" | cut -f1)" >&2
fi
echo "$TARBALL"
