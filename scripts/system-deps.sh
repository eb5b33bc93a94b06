#!/usr/bin/env bash
# System packages the test suite uses: iproute2 (network namespaces, tc) and
# OpenSSH's server (a "remote host" in a namespace). Installed with apt only
# when missing and only as root; otherwise those tests skip and say why.
set -euo pipefail
missing=()
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
[ -x /usr/sbin/sshd ] || missing+=(openssh-server)
command -v ssh >/dev/null 2>&1 || missing+=(openssh-client)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "system-deps: not installing ${missing[*]} (needs root and apt-get); the tests that need them will skip" >&2
    exit 0
fi
echo "system-deps: apt-get install ${missing[*]}" >&2
apt-get update -qq >/dev/null
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
