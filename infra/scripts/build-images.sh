#!/usr/bin/env bash
# Build the jetrl images (one per service) from infra/Dockerfile and print their sizes.
#   infra/scripts/build-images.sh                      # from the package index, BASE = python slim
#   infra/scripts/build-images.sh --offline [WHEELS]   # no index: wheels from infra/scripts/wheelhouse.sh
# Options: --base IMAGE (e.g. localhost/jetrl-base:bookworm from make-base.sh), --tag TAG (default
# latest), --builder podman|docker (default: podman if present), then the targets (default: all).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
# One build of the images at a time on this machine (two test runs side by side build the same tags):
# the second waits, then builds from the layer cache. flock -o: the lock is not inherited by the builds.
LOCKS=${JETRL_CACHE:-$HOME/.cache/jetrl}
if [ -z "${_JETRL_IMAGES_LOCKED:-}" ] && command -v flock >/dev/null && mkdir -p "$LOCKS"; then
  exec env _JETRL_IMAGES_LOCKED=1 flock -o "$LOCKS/.build-images.lock" "$0" "$@"
fi
TAG=latest BASE="" WHEELS="" OFFLINE=0
BUILDER=${BUILDER:-$(command -v podman >/dev/null && echo podman || echo docker)}
TARGETS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --offline) OFFLINE=1; if [ $# -gt 1 ] && [ "${2#--}" = "$2" ] && [ -d "$2" ]; then WHEELS=$2; shift; fi ;;
    --base) BASE=$2; shift ;;
    --tag) TAG=$2; shift ;;
    --builder) BUILDER=$2; shift ;;
    -h|--help) sed -n 2,7p "$0"; exit 0 ;;
    *) TARGETS+=("$1") ;;
  esac
  shift
done
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(nats weights reward rollout inference trainer)

# A small build context: only what the Dockerfile copies (the repo's .venv and runs stay out).
CTX=$(mktemp -d)
trap 'rm -rf "$CTX"' EXIT
mkdir -p "$CTX/infra"
cp -r "$ROOT/infra/requirements" "$ROOT/infra/nats-server.conf" "$ROOT/infra/Dockerfile" "$CTX/infra/"
cp -r "$ROOT/schemas" "$ROOT/services" "$CTX/"
find "$CTX" -name __pycache__ -prune -exec rm -rf {} +

args=(-f "$CTX/infra/Dockerfile")
[ -n "$BASE" ] && args+=(--build-arg "BASE=$BASE")
if [ "$OFFLINE" = 1 ]; then
  start=$SECONDS
  WHEELS=${WHEELS:-$("$ROOT/infra/scripts/wheelhouse.sh")}
  echo "== wheelhouse $WHEELS in $((SECONDS - start)) s"
  args+=(--volume "$WHEELS:/wheels:ro" --build-arg PIP_NO_INDEX=1 --build-arg PIP_FIND_LINKS=/wheels)
  [ "$BUILDER" = podman ] && args+=(--network none)  # nothing to fetch: prove it
fi
for target in "${TARGETS[@]}"; do
  echo "== building jetrl-$target:$TAG"
  start=$SECONDS
  "$BUILDER" build "${args[@]}" --target "$target" -t "jetrl-$target:$TAG" "$CTX"
  echo "== built jetrl-$target:$TAG in $((SECONDS - start)) s"
done
echo "== image sizes"
for target in "${TARGETS[@]}"; do
  "$BUILDER" image inspect --format "jetrl-$target:$TAG {{.Size}}" "jetrl-$target:$TAG" \
    | awk '{printf "%-28s %8.0f MB\n", $1, $2 / 1e6}'
done
