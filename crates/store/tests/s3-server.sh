#!/usr/bin/env bash
# The S3-compatible server the store's S3 tests run against: moto's server
# mode (PyPI `moto[server]`), in its own virtualenv. Garage, the project's
# preferred server, takes ~20 min to build here (docs/design/store.md).
#   s3-server.sh install        # as root: /opt/tine-s3 (idempotent); scripts/setup calls it
#   s3-server.sh path           # prints the server binary, exit 1 if not installed
#   s3-server.sh run PORT       # runs it on 127.0.0.1:PORT in the foreground
# The tests (crates/store/tests/s3.rs) start their own server with `path`'s
# binary on a free port; TINE_S3_SERVER overrides the binary.
set -euo pipefail
VENV=${TINE_S3_VENV:-/opt/tine-s3}
MOTO_VERSION=5.2.5
bin="$VENV/bin/moto_server"

case "${1:-}" in
install)
  if [[ -x $bin ]] && "$VENV/bin/python" -c "import moto, sys; sys.exit(moto.__version__ != '$MOTO_VERSION')" 2>/dev/null; then
    exit 0
  fi
  echo "s3-server: installing moto[server]==$MOTO_VERSION into $VENV" >&2
  if ! python3 -m venv --help >/dev/null 2>&1; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
  fi
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check "moto[server]==$MOTO_VERSION"
  "$bin" --help >/dev/null
  ;;
path)
  b=${TINE_S3_SERVER:-$bin}
  [[ -x $b ]] || { echo "s3-server: $b is not installed (run: $0 install)" >&2; exit 1; }
  echo "$b"
  ;;
run)
  exec "${TINE_S3_SERVER:-$bin}" -H 127.0.0.1 -p "${2:?port}"
  ;;
*)
  sed -n '2,9p' "$0" >&2
  exit 2
  ;;
esac
