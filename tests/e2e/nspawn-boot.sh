#!/bin/sh
# usage: unshare --mount --propagation private nspawn-boot.sh ROOT [systemd-nspawn args]
# Boots ROOT with systemd as PID 1 (from ../shared/recipes/systemd-e2e, checked on Debian 12 hosts
# whose own PID 1 is not systemd).
set -e
root=$1; shift
# This host's /run may be plain disk: give nspawn a throwaway tmpfs /run in our private mount
# namespace, or it refuses to clean /run/systemd/nspawn/propagate/<name>.
mount -t tmpfs -o mode=755 tmpfs /run
# --register=no --keep-unit: no machined or system bus on the host.
exec systemd-nspawn -D "$root" -b --register=no --keep-unit --console=passive "$@"
