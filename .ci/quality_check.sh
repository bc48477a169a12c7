#!/usr/bin/env bash
# CI step: the quality-per-bit comparison's quick check with the peer quantizers installed (hqq, bitsandbytes,
# torchao, optimum-quanto: the `quality` extra), in its own virtual environment so that the main test environment
# stays as a user's. `make test` runs the same tests with only EXL3 and the round-to-nearest baseline.
#   QUALITY_VENV  where the venv lives (default: .ci/cache/quality-venv if .ci/cache exists, else .quality-venv);
#                 reused when its stamp matches this script and pyproject.toml
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -d .ci/cache ]; then default_venv=.ci/cache/quality-venv; else default_venv=.quality-venv; fi
VENV="${QUALITY_VENV:-$default_venv}"
STAMP="$VENV/.exl3rt-stamp"
want="$(cat "$0" pyproject.toml | sha256sum | cut -c1-16)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
    rm -rf "$VENV"
    python3.11 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --upgrade pip
    "$VENV/bin/pip" install --quiet torch==2.13.0          # the CPU build (local find-links)
    "$VENV/bin/pip" install --quiet -e '.[test,quality]'
    echo "$want" > "$STAMP"
fi
"$VENV/bin/pip" install --quiet --no-deps -e .
# every CPU peer must run here: a missing one would pass as "not run"
EXL3RT_QUALITY_PEERS_REQUIRED=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    tests/test_quality_compare.py tests/test_quality_peers.py
