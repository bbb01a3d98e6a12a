#!/usr/bin/env bash
# Make sure a Debian package's commands are installed: ensure-debian-tool.sh PACKAGE COMMAND...
# The tests start these servers themselves on loopback (prometheus, docker-registry); they never run as daemons, so
# the service the package may start is kept from starting, and stopped if it did.
set -euo pipefail
package=$1
shift
missing=0
for command in "$@"; do command -v "$command" >/dev/null || missing=1; done
if [ "$missing" = 0 ]; then exit 0; fi
if [ "$(id -u)" != 0 ]; then
  echo "$* missing: run 'sudo apt-get install -y --no-install-recommends $package'" >&2
  exit 1
fi
echo "installing $package from Debian ..."
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# policy-rc.d keeps the package from starting a daemon during install.
printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
apt-get install -y -qq --no-install-recommends "$package" >/dev/null
rm -f /usr/sbin/policy-rc.d
pkill -x "$1" 2>/dev/null || true
"$1" --version 2>&1 | sed -n 1p
