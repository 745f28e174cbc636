#!/bin/sh
# Install the Debian packages that `make venv` needs (Debian's python3 with venv and headers, and
# what systemd-python compiles against). As root it runs apt-get; otherwise it prints the command.
# Extra packages may be passed as arguments (.ci/run adds the packaging and e2e tools).
#
# --deb: also what `make deb` needs: git and dpkg-dev (the Makefile's own steps), then debian/control's
# Build-Depends (debhelper-compat (= 13), ...) and build-essential, as dpkg-checkbuilddeps sees
# them, installed by `apt-get build-dep ./` (run in the source tree, so debian/control is the one
# list). Without it a fresh Debian 12 stops at "Unmet build dependencies: debhelper-compat (= 13)".
set -eu
deb=no
if [ "${1:-}" = "--deb" ]; then
    deb=yes
    shift
    set -- git dpkg-dev "$@"
fi
want="make python3 python3-venv python3-dev gcc pkg-config libsystemd-dev $*"
missing=""
for p in $want; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
updated=no
if [ -n "$missing" ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "missing Debian packages:$missing" >&2
        echo "run: sudo apt-get install$missing" >&2
        [ "$deb" = yes ] && echo "then: sudo apt-get build-dep ./   (debian/control's Build-Depends)" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    updated=yes
    apt-get install -y -q --no-install-recommends $missing
fi
[ "$deb" = yes ] || exit 0
unmet=$(dpkg-checkbuilddeps 2>&1) && exit 0
unmet=$(printf '%s\n' "$unmet" | sed -n 's/.*Unmet build dependencies: *//p')
if [ "$(id -u)" -ne 0 ]; then
    echo "missing build dependencies of debian/control: ${unmet:-see dpkg-checkbuilddeps}" >&2
    echo "run: sudo apt-get build-dep ./   (in $(pwd))" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
[ "$updated" = yes ] || apt-get update -q
apt-get build-dep -y -q --no-install-recommends ./
dpkg-checkbuilddeps
