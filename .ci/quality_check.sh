#!/usr/bin/env bash
# CI step: the quality-per-bit comparison's quick check with the peer quantizers installed (hqq, bitsandbytes,
# torchao, optimum-quanto: the `quality` extra), in its own virtual environment so that the main test environment
# stays as a user's. `make test` runs the same tests with only EXL3 and the round-to-nearest baseline.
#   QUALITY_VENV  where the venv lives (default: .ci/cache/quality-venv if .ci/cache exists, else .quality-venv);
#                 reused when its stamp matches this script and pyproject.toml
set -euo pipefail
cd "$(dirname "$0")/.."
install_into() { "$1/bin/pip" install --quiet -e '.[test,quality]'; }
. .ci/venv.sh
ci_venv quality-venv QUALITY_VENV
"$VENV/bin/pip" install --quiet --no-deps -e .
# every CPU peer must run here: a missing one would pass as "not run"
EXL3RT_QUALITY_PEERS_REQUIRED=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    tests/test_quality_compare.py tests/test_quality_peers.py
