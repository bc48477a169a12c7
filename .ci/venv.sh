# Sourced by the CI steps that need their own virtual environment. `ci_venv NAME VAR` sets VENV to $VAR if set,
# else .ci/cache/NAME where .ci/cache exists, else .NAME; a venv whose stamp differs from the calling script and
# pyproject.toml is made again: torch's CPU build (local find-links), then the caller's `install_into VENV`.
ci_venv() {
    local name=$1 var=$2 stamp want
    if [ -d .ci/cache ]; then VENV=.ci/cache/$name; else VENV=.$name; fi
    VENV="${!var:-$VENV}"
    stamp="$VENV/.exl3rt-stamp"
    want="$(cat "$0" pyproject.toml | sha256sum | cut -c1-16)"
    if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
        rm -rf "$VENV"
        python3.11 -m venv "$VENV"
        "$VENV/bin/pip" install --quiet --upgrade pip
        "$VENV/bin/pip" install --quiet torch==2.13.0
        install_into "$VENV"
        echo "$want" > "$stamp"
    fi
}
