#!/bin/sh
# Install the Debian packages that `make venv` needs (Debian's python3 with venv and headers, and
# what systemd-python compiles against). As root it runs apt-get; otherwise it prints the command.
# Extra packages may be passed as arguments (.ci/run adds the packaging and e2e tools).
set -eu
want="make python3 python3-venv python3-dev gcc pkg-config libsystemd-dev $*"
missing=""
for p in $want; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
    echo "missing Debian packages:$missing" >&2
    echo "run: sudo apt-get install$missing" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends $missing
