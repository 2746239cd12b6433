#!/usr/bin/env bash
# Installs the tools the API's contract check runs on the served OpenAPI document
# (crates/cli/tests/openapi_tools.rs), once, into one directory:
#
#   venv/  openapi-spec-validator, openapi-python-client, and what a generated client imports
#   npm/   @stoplight/spectral-cli, openapi-typescript, typescript
#
#   scripts/openapi-tools.sh        # prints the directory on stdout; progress on stderr
#
# The directory is $REIN_OPENAPI_TOOLS, else target/openapi-tools. The versions are pinned;
# changing one below reinstalls. Needs python3 (with venv) and npm, and PyPI and the npm
# registry within reach; exits non-zero when anything is missing or fails.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
DIR=${REIN_OPENAPI_TOOLS:-${CARGO_TARGET_DIR:-$PWD/target}/openapi-tools}

PY_PACKAGES=(
  openapi-spec-validator==0.9.0
  openapi-python-client==0.29.1
  httpx==0.28.1
  attrs==26.1.0
  python-dateutil==2.9.0.post0
)
NPM_PACKAGES=(
  @stoplight/spectral-cli@6.16.3
  openapi-typescript@7.13.0
  typescript@5.9.3
)
WANT="${PY_PACKAGES[*]} ${NPM_PACKAGES[*]}"
STAMP=$DIR/installed

say() { printf '   %s\n' "$*" >&2; }

mkdir -p "$DIR"
# One install at a time: the test and this script may both ask.
exec 9>"$DIR/.lock"
if command -v flock >/dev/null; then
  flock 9
fi

if [[ -f $STAMP && $(cat "$STAMP") == "$WANT" ]]; then
  echo "$DIR"
  exit 0
fi

for tool in python3 npm; do
  if ! command -v "$tool" >/dev/null; then
    say "$tool is not on PATH (Debian: apt-get install python3-venv npm)"
    exit 1
  fi
done

rm -f "$STAMP"
say "installing into $DIR: ${PY_PACKAGES[*]}"
rm -rf "$DIR/venv"
python3 -m venv "$DIR/venv"
"$DIR/venv/bin/pip" install --quiet --disable-pip-version-check "${PY_PACKAGES[@]}" >&2
say "installing into $DIR: ${NPM_PACKAGES[*]}"
mkdir -p "$DIR/npm"
npm install --prefix "$DIR/npm" --no-audit --no-fund --no-save --silent \
  --no-package-lock "${NPM_PACKAGES[@]}" >&2
for bin in venv/bin/openapi-spec-validator venv/bin/openapi-python-client \
  npm/node_modules/.bin/spectral npm/node_modules/.bin/openapi-typescript \
  npm/node_modules/.bin/tsc; do
  if [[ ! -x $DIR/$bin ]]; then
    say "installed, but $DIR/$bin is missing"
    exit 1
  fi
done
echo "$WANT" >"$STAMP"
echo "$DIR"
