#!/usr/bin/env bash
# The Python the SDK tests run with: a venv of Debian's python3 holding
# requirements-test.txt (pinned), in /opt/tine-py (TINE_PY_VENV).
#   sdk/python/venv.sh install   # (re)creates it when the pins changed
#   sdk/python/venv.sh path      # its python, or exit 1 when absent/stale
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
VENV=${TINE_PY_VENV:-/opt/tine-py}
req="$here/requirements-test.txt"
stamp="$VENV/.requirements.sha256"
want=$(sha256sum "$req" | cut -d' ' -f1)
fresh() { [[ -x $VENV/bin/python && -f $stamp && $(cat "$stamp") == "$want" ]]; }
case "${1:-}" in
install)
	fresh && exit 0
	echo "sdk/python/venv.sh: installing $(grep -v '^#' "$req" | tr '\n' ' ')into $VENV" >&2
	rm -rf "$VENV"
	/usr/bin/python3 -m venv "$VENV"
	"$VENV/bin/pip" install -q --disable-pip-version-check -r "$req"
	echo "$want" >"$stamp"
	;;
path)
	fresh || { echo "sdk/python/venv.sh: no current venv in $VENV (run: sdk/python/venv.sh install)" >&2; exit 1; }
	echo "$VENV/bin/python"
	;;
*)
	sed -n '2,5p' "$0" >&2
	exit 2
	;;
esac
