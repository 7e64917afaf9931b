#!/usr/bin/env bash
# Build a Debian bookworm base image with Python 3.11 from the Debian archive (debootstrap) and
# import it into podman as localhost/jetrl-base:bookworm. For machines that reach the Debian archive
# but no container registry; elsewhere use the default BASE (the official python slim image).
# Usage: infra/scripts/make-base.sh [CACHE_DIR]   (default ~/.cache/jetrl)
set -euo pipefail
CACHE=${1:-${JETRL_CACHE:-$HOME/.cache/jetrl}}
IMAGE=${JETRL_BASE_IMAGE:-localhost/jetrl-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
TARBALL="$CACHE/base-bookworm.tar"
mkdir -p "$CACHE"
# One build at a time per cache (two test runs side by side share it): the second waits, then reuses.
# flock -o: the lock is flock's own, not inherited by what this script starts.
if [ -z "${_JETRL_BASE_LOCKED:-}" ] && command -v flock >/dev/null; then
  exec env _JETRL_BASE_LOCKED=1 flock -o "$CACHE/.make-base.lock" "$0" "$@"
fi
if [ ! -s "$TARBALL" ]; then
  root=$(mktemp -d "$CACHE/rootfs.XXXXXX")
  tmp=$(mktemp "$TARBALL.XXXXXX")
  trap 'rm -rf "$root" "$tmp"' EXIT
  # minbase + python: what the official slim image has that the services use (venv, certificates).
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$MIRROR"
  chroot "$root" apt-get clean
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/usr/share/doc/* "$root"/usr/share/man/*
  tar -C "$root" -cf "$tmp" .
  mv "$tmp" "$TARBALL"
fi
if ! podman image exists "$IMAGE"; then
  podman import --change 'CMD ["/bin/bash"]' --change 'ENV LANG=C.UTF-8' "$TARBALL" "$IMAGE" >/dev/null
fi
echo "$IMAGE"
