#!/usr/bin/env bash
# Create the repository's virtual environment (.venv) with the pinned tools of
# requirements-dev.txt. Idempotent: a second call with unchanged requirements does nothing.
# Needs only python3 (3.10 or newer) and bash.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.requirements-sha256"
wanted="$(python3 -c 'import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest())' "$root/requirements-dev.txt")"

if [[ -x "$venv/bin/python" && "$(cat "$stamp" 2>/dev/null)" == "$wanted" ]]; then
  exit 0
fi
echo "setting up $venv (one time) ..."
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$root/requirements-dev.txt"
echo "$wanted" >"$stamp"
