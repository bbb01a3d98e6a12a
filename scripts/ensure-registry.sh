#!/usr/bin/env bash
# Make sure Debian's docker-registry (the CNCF distribution registry) is installed. The model delivery tests start
# it themselves on loopback; it is never run as a daemon, so stop the service the package may have started.
set -euo pipefail
if command -v docker-registry >/dev/null; then exit 0; fi
if [ "$(id -u)" != 0 ]; then
  echo "docker-registry missing: run 'sudo apt-get install -y --no-install-recommends docker-registry'" >&2
  exit 1
fi
echo "installing docker-registry from Debian ..."
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# policy-rc.d keeps the package from starting a daemon during install.
printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
apt-get install -y -qq --no-install-recommends docker-registry >/dev/null
rm -f /usr/sbin/policy-rc.d
pkill -x docker-registry 2>/dev/null || true
docker-registry --version 2>&1 | sed -n 1p
