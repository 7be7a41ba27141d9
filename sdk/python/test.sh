#!/usr/bin/env bash
# The SDK's tests against a real tined (scripts/test runs this): the package
# installed from this tree into the test venv, then pytest. Micro-guest
# tests run here on /dev/kvm; Linux-guest tests (-m linux) run in the nested
# test host where this machine cannot boot Linux (testhost/run), retried
# like testhost/cargo-runner retries a test binary when the nested host
# itself dies (exit 125).
#   sdk/python/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/../.."
py=$(sdk/python/venv.sh path)
"$py" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation --force-reinstall ./sdk/python
rm -rf sdk/python/build sdk/python/*.egg-info
args=(-q -p no:cacheprovider --rootdir sdk/python "$@")
# pytest's exit 5 is "no test selected" (a -k filter for the other half).
"$py" -m pytest "${args[@]}" -m "not linux" sdk/python/tests || (($? == 5))
# Whether Linux guests boot on this machine's /dev/kvm.
if [[ -e /sys/module/kvm_pvm || ! ( -e /sys/module/kvm_amd || -e /sys/module/kvm_intel ) ]]; then
	tries=$((${TINE_TESTHOST_RETRIES:-2} + 1))
	for ((i = 1; ; i++)); do
		rc=0
		testhost/run --timeout "${TINE_TESTHOST_TIMEOUT:-900}" -- "$py" -m pytest "${args[@]}" -m linux sdk/python/tests || rc=$?
		((rc == 5)) && exit 0
		((rc == 125 && i < tries)) || exit $rc
		echo "RETRY: sdk/python linux tests: the nested host died (exit 125), run $((i + 1)) of $tries" >&2
	done
else
	"$py" -m pytest "${args[@]}" -m linux sdk/python/tests || (($? == 5))
fi
