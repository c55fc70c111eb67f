#!/usr/bin/env bash
# Sourced by the other launch scripts: creates ./.venv on first use and installs dapo_jax into it.
#   source launch/setup_env.sh runtime    # the package and its run-time dependencies
#   source launch/setup_env.sh test       # plus the [test] extra (pytest, torch CPU, ...)
# The argument is required: a sourced script otherwise sees its caller's arguments as "$1".
# Re-running is cheap: pip only installs what is missing.
set -euo pipefail
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
case "${1:-}" in
  runtime) _extra="" ;;
  test) _extra="test" ;;
  *) echo "usage: source launch/setup_env.sh runtime|test (got '${1:-}')" >&2; return 2 ;;
esac
_py="${PYTHON:-python3}"
if [ ! -x "$_root/.venv/bin/python" ]; then
  echo "[setup_env] creating $_root/.venv with $($_py --version)"
  "$_py" -m venv "$_root/.venv"
  "$_root/.venv/bin/python" -m pip install -q --upgrade pip
fi
# shellcheck disable=SC1091
source "$_root/.venv/bin/activate"
_spec="$_root"
[ -n "$_extra" ] && _spec="${_root}[${_extra}]"
echo "[setup_env] pip install -e '$_spec'"
# Two notices of a sound install are left out, nothing else (a failed pip still fails, with all
# it said): setuptools' "Editable installation" reminder box, printed on every editable install,
# and the conflicts pip reports for the google-jetstream requirements that the no-deps install
# below leaves out on purpose (requirements-no-deps.txt); `pip check` then shows any other.
PYTHONWARNINGS="ignore:Editable installation" python -m pip install -q --no-warn-conflicts \
  -e "$_spec"
# JetStream without the TensorFlow its metadata asks for (setup.py says why).
python -m pip install -q --no-deps -r "$_root/requirements-no-deps.txt"
_expected="^google-jetstream [^ ]+ requires (seqio|blobfile|coverage|parameterized|portpicker"
_expected+="|pytest), which is not installed\.$|^No broken requirements found\.$"
_conflicts="$(python -m pip check 2> /dev/null | grep -Ev "$_expected" || true)"
if [ -n "$_conflicts" ]; then
  echo "[setup_env] pip check: broken requirements (besides google-jetstream's expected ones):" >&2
  echo "$_conflicts" >&2
fi
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-3}"
export TOKENIZERS_PARALLELISM=false
