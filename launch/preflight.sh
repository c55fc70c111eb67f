#!/usr/bin/env bash
# Sourced by the launch scripts. dapo_preflight ROOT ARG...: python -m dapo_jax.commands.launch_preflight
# ARG... with the checkout at ROOT (its code, not an installed copy), in the first Python found:
# $DAPO_PYTHON, the active virtualenv's, ROOT/.venv's, python3. Returns 2 when the launch is
# refused or no Python is found (one line on stderr each).
dapo_preflight() {
  local root="$1" py="${DAPO_PYTHON:-}" candidate
  shift
  if [ -n "$py" ]; then
    py="$(command -v "$py" || echo "$py")"  # a name on PATH or a path
  else
    for candidate in "${VIRTUAL_ENV:+$VIRTUAL_ENV/bin/python}" "$root/.venv/bin/python" \
                     "$(command -v python3 || true)"; do
      if [ -n "$candidate" ] && [ -x "$candidate" ]; then py="$candidate"; break; fi
    done
  fi
  if [ -z "$py" ] || ! [ -x "$py" ]; then
    echo "launch preflight: error: no local Python to check the launch with" \
         "(${py:-none found}): set DAPO_PYTHON to one with dapo_jax installed, or pass" \
         "--skip-preflight" >&2
    return 2
  fi
  # The checks need no accelerator: the CPU backend keeps JAX from probing for one.
  PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" JAX_PLATFORMS=cpu \
    "$py" -m dapo_jax.commands.launch_preflight "$@" || return 2
}
