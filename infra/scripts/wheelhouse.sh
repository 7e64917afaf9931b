#!/usr/bin/env bash
# Build (or reuse) a wheelhouse with every wheel the images need, resolved on this machine, so image
# builds can run with no package index (`--no-index --find-links`). Versions are pinned to what the
# current Python environment has installed, so the images run what the tests ran.
# Usage: infra/scripts/wheelhouse.sh [DIR]   (default ~/.cache/jetrl/wheelhouse)
set -euo pipefail
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$0")/../.."
DIR=${1:-${JETRL_CACHE:-$HOME/.cache/jetrl}/wheelhouse}
PY=${PYTHON:-python}
mkdir -p "$DIR"
# One build at a time per wheelhouse (two test runs side by side share it): the second waits, then reuses.
if [ -z "${_JETRL_WHEELS_LOCKED:-}" ] && command -v flock >/dev/null; then
  exec env _JETRL_WHEELS_LOCKED=1 flock -o "$DIR/.lock" "$SELF" "$@"
fi
stamp="$DIR/.stamp"
want=$(cat infra/requirements/*.txt | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "$DIR"
  exit 0
fi
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
# The installed versions, without the project itself (it is built inside the image).
"$PY" -m pip freeze --exclude-editable | grep -v -i '^jetrl' >"$constraints"
reqs=()
for f in infra/requirements/*.txt; do reqs+=(-r "$f"); done
"$PY" -m pip wheel -q --wheel-dir "$DIR" -c "$constraints" "${reqs[@]}"
echo "$want" >"$stamp"
echo "$DIR"
