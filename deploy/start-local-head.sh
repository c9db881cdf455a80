#!/usr/bin/env bash
# Start a Ray head with the dashboard on this machine, for single-machine use of `ray job submit`.
#   bash deploy/start-local-head.sh            # then: .venv/bin/ray job submit --working-dir . -- python -m jobs.train ...
# The head starts from .venv with .venv/bin first on its PATH, so a job's entrypoint `python` is .venv's python
# (the one with torch, Ray and rlsys's dependencies), from whatever directory the job is submitted.
# Ray 2.60 turns token auth on for local clusters: the head and every `ray job` client need the same
# RAY_AUTH_MODE (exported here; export it in your shell too); the dashboard asks once for the token that
# `ray get-auth-token` prints (~/.ray/auth_token). Stop with `ray stop` (every Ray on the machine).
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
RAY=${RAY:-.venv/bin/ray}
[ -x "$RAY" ] || RAY=$(command -v ray)
RAY_BIN=$(cd "$(dirname "$RAY")" && pwd)
export PATH="$RAY_BIN:$PATH"
DASHBOARD_PORT=${DASHBOARD_PORT:-8265}
echo "Jobs' python: $(command -v python)"
# The dashboard binds 127.0.0.1: reach it from elsewhere through an SSH tunnel, not an open port.
"$RAY_BIN/ray" start --head --include-dashboard=true --dashboard-host=127.0.0.1 --dashboard-port="$DASHBOARD_PORT" \
  --disable-usage-stats "$@"
echo
echo "Ray head up. Dashboard: http://127.0.0.1:$DASHBOARD_PORT   (RAY_AUTH_MODE=$RAY_AUTH_MODE; it asks for the token of:  $RAY_BIN/ray get-auth-token)"
echo "Submit:  RAY_AUTH_MODE=$RAY_AUTH_MODE $RAY_BIN/ray job submit --address http://127.0.0.1:$DASHBOARD_PORT --working-dir . -- python -m jobs.train --config configs/tictactoe-tiny-cpu.toml"
echo "Follow:  RAY_AUTH_MODE=$RAY_AUTH_MODE $RAY_BIN/ray job logs --address http://127.0.0.1:$DASHBOARD_PORT --follow <submission id>"
echo "Stop:    RAY_AUTH_MODE=$RAY_AUTH_MODE $RAY_BIN/ray job stop --address http://127.0.0.1:$DASHBOARD_PORT <submission id>   (checkpoints, then exits)"
