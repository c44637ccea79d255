#!/usr/bin/env bash
# Install what the chaos suite needs (Debian/Ubuntu, as root). Idempotent; quick when already installed.
#   iproute2 (ip netns, veth, bridge), iptables (partitions, loss), haproxy (the load balancer),
#   libfaketime (clock skew), procps (ps/pgrep for debugging leftovers), dnsmasq-base (the DNS server of
#   the DNS-seed test, tests/chaos/test_dns_seeds.py: the binary only, no system service).
set -euo pipefail

if [ "$(id -u)" != "0" ]; then
    echo "chaos/install.sh: must run as root" >&2
    exit 1
fi

need=()
have_bin() { command -v "$1" >/dev/null 2>&1; }
have_faketime() {
    for d in /usr/lib/*/faketime /usr/lib/faketime /usr/lib64/faketime; do
        [ -e "$d/libfaketime.so.1" ] && return 0
    done
    return 1
}
have_bin ip || need+=(iproute2)
have_bin iptables || need+=(iptables)
have_bin haproxy || need+=(haproxy)
have_faketime || need+=(libfaketime)
have_bin dnsmasq || need+=(dnsmasq-base)

if [ "${#need[@]}" -eq 0 ]; then
    echo "chaos/install.sh: everything is installed"
    exit 0
fi

echo "chaos/install.sh: installing ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
# an update only when the package lists are missing or older than a day
if [ -z "$(find /var/lib/apt/lists -maxdepth 1 -name '*_Packages*' -mtime -1 2>/dev/null | head -1)" ]; then
    apt-get update -qq
fi
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
# the Debian haproxy package may start a system service; the suite runs its own instances only
if have_bin systemctl && systemctl is-active --quiet haproxy 2>/dev/null; then
    systemctl stop haproxy || true
fi
echo "chaos/install.sh: done"
