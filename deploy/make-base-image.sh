#!/bin/sh
# A Python 3.11 base image made from Debian's packages, for a machine that cannot pull
# python:3.11-slim (no Docker Hub, only a Debian mirror): debootstrap bookworm (whose python3
# is 3.11), without apt's caches, docs and locales, then `docker import`.
#
#   deploy/make-base-image.sh [NAME [MIRROR]]      # root; apt-get install debootstrap docker.io
#   docker build --build-arg BASE_IMAGE=NAME ...   # or: make compose-check TANDEM_BASE_IMAGE=NAME
#
# NAME defaults to tandem-base:bookworm, MIRROR to http://deb.debian.org/debian.
set -eu
name=${1:-tandem-base:bookworm}
mirror=${2:-http://deb.debian.org/debian}
rootfs=$(mktemp -d)
chmod 755 "$rootfs"   # it becomes the image's /, which mktemp made 0700 (root only)
trap 'rm -rf "$rootfs"' EXIT INT TERM
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$rootfs" "$mirror"
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
    "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
    "$rootfs"/usr/share/locale/*
tar -C "$rootfs" -c . | docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$name"
docker image ls "$name"
