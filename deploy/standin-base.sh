#!/usr/bin/env bash
# A stand-in for the registry's python:3.11-slim-bookworm, made from Debian's own packages, for a machine
# that reaches Debian and PyPI but no container registry. Debian's python3.11 in a venv at /usr/local, so
# `python`, `python3` and `pip` sit where the registry image has them; this machine's extra CA
# certificates (a TLS-inspecting egress) are trusted, and pip uses the system bundle.
#
#   deploy/standin-base.sh [TAG]        # default localhost/python:3.11-slim-bookworm; prints the tag
#
# Then build with --build-arg BASE=TAG. Needs root, debootstrap and podman (or docker: ENGINE=docker).
# Does nothing when TAG already exists (delete the image to rebuild it).
set -euo pipefail
TAG=${1:-localhost/python:3.11-slim-bookworm}
ENGINE=${ENGINE:-podman}
MIRROR=${MIRROR:-http://deb.debian.org/debian}

if "$ENGINE" image inspect "$TAG" >/dev/null 2>&1; then
    echo "$TAG"
    exit 0
fi
root=$(mktemp -d /var/tmp/sbpflow-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase bookworm "$root" "$MIRROR" >&2
# installed by apt inside, not by debootstrap --include (whose resolver fails on python3.11-venv)
chroot "$root" bash -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    --no-install-recommends python3.11 python3.11-venv ca-certificates' >&2
for crt in /usr/local/share/ca-certificates/*.crt; do
    [ -e "$crt" ] && cp "$crt" "$root/usr/local/share/ca-certificates/"
done
chroot "$root" update-ca-certificates >&2
chroot "$root" python3.11 -m venv /usr/local
chroot "$root" /usr/local/bin/python -m pip --version >&2
chroot "$root" apt-get clean
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/usr/share/doc/* "$root"/usr/share/man/*
tar -C "$root" --numeric-owner -c . | "$ENGINE" import \
    --change 'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change 'CMD ["python3"]' \
    - "$TAG" >&2
echo "$TAG"
