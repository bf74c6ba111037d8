#!/usr/bin/env bash
# Run a fast subset of haloshard's tests on one torch release, in a venv of its own.
#
#   scripts/torch_versions.sh VERSION [PYTEST_ARGS...]     e.g. scripts/torch_versions.sh 2.12.1
#
# Makes (or reuses) /tmp/haloshard-torch-VERSION and installs torch==VERSION with pip's own
# dependency resolution (from the index these are CUDA builds of several GB; point pip at a
# folder of wheels fetched earlier with WHEELS=/path), einops, pytest, hypothesis and numpy;
# then this checkout as a wheel without dependencies, and `pip check`s that the package's
# declared torch range accepts VERSION. It runs the compat, import, layout, exchange, conv,
# hooks, redistribute, attention, norms, errors and testing-helper tests (simulated ranks and
# 2-4 gloo processes; no diffusers, notebooks or compile tests; more files or pytest options
# can follow VERSION) and ends with one line, e.g.
#   torch 2.12.1+cu130 (2026-12-04): 326 passed, 2 skipped in 650.00s [673s, log ...]
# CI keeps the pinned torch; this script checks another release by hand.
set -euo pipefail

version=${1:?usage: scripts/torch_versions.sh VERSION [PYTEST_ARGS...]}
shift
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=/tmp/haloshard-torch-$version
python=${PYTHON:-python3}
files=(tests/test_compat.py tests/test_import.py tests/test_layout.py tests/test_exchange.py
       tests/test_conv.py tests/test_hooks.py tests/test_redistribute.py
       tests/test_attention.py tests/test_masked_attention.py tests/test_norms.py
       tests/test_errors.py tests/test_testing.py)

# Set-up output (pip's warnings included) goes to a log, shown only if a step fails.
setup() {
    "$@" >> "$venv/setup.log" 2>&1 || { tail -30 "$venv/setup.log"; exit 1; }
}
[[ -x $venv/bin/python ]] || "$python" -m venv "$venv"
: > "$venv/setup.log"
links=()
[[ -d ${WHEELS:-} ]] && links=(--find-links "$WHEELS")
# numpy: torch does not require it, but torch.distributed.tensor.debug (CommDebugMode, which
# tests outside the subset use) imports it.
setup "$venv/bin/pip" install "${links[@]}" "torch==$version" "einops>=0.7" "pytest>=8" \
    "hypothesis>=6.100" numpy
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
setup "$venv/bin/pip" wheel --no-deps -w "$build" "$repo"
setup "$venv/bin/pip" install --no-deps --force-reinstall "$build"/haloshard-*.whl
# The package's declared torch range must accept this release.
setup "$venv/bin/pip" check
installed=$("$venv/bin/python" -c "import torch; print(torch.__version__)" 2>/dev/null)

# From the checkout (the tests and pyproject's pytest settings), against the installed wheel.
log=$venv/pytest.log
start=$SECONDS
set +e
(cd "$repo" && env -u PYTHONPATH "$venv/bin/python" -m pytest -q -p no:cacheprovider "${files[@]}" "$@") \
    > "$log" 2>&1
status=$?
set -e
summary=$(grep -E '^=*.*[0-9]+ (passed|failed|errors?|skipped)' "$log" | tail -1 | tr -d '=' \
          | xargs || true)
echo "torch $installed ($(date -u +%F)): ${summary:-no summary, see $log} [$((SECONDS - start))s," \
    "log $log]"
exit $status
