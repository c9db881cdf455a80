#!/usr/bin/env bash
# Start a Ray head with the dashboard on this machine, for single-machine use of `ray job submit`.
#   bash deploy/start-local-head.sh            # then: ray job submit --working-dir . -- python -m jobs.train ...
# Ray 2.60 turns token auth on for local clusters: the head and every `ray job` client need the same
# RAY_AUTH_MODE (exported here; export it in your shell too). Stop with `ray stop`.
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
RAY=${RAY:-.venv/bin/ray}
[ -x "$RAY" ] || RAY=ray
DASHBOARD_PORT=${DASHBOARD_PORT:-8265}
# The dashboard binds 127.0.0.1: reach it from elsewhere through an SSH tunnel, not an open port.
"$RAY" start --head --include-dashboard=true --dashboard-host=127.0.0.1 --dashboard-port="$DASHBOARD_PORT" \
  --disable-usage-stats "$@"
echo
echo "Ray head up. Dashboard: http://127.0.0.1:$DASHBOARD_PORT   (RAY_AUTH_MODE=$RAY_AUTH_MODE)"
echo "Submit:  RAY_AUTH_MODE=$RAY_AUTH_MODE $RAY job submit --address http://127.0.0.1:$DASHBOARD_PORT --working-dir . -- python -m jobs.train --config configs/tictactoe-tiny-cpu.toml"
echo "Follow:  RAY_AUTH_MODE=$RAY_AUTH_MODE $RAY job logs --address http://127.0.0.1:$DASHBOARD_PORT --follow <submission id>"
echo "Stop:    RAY_AUTH_MODE=$RAY_AUTH_MODE $RAY job stop --address http://127.0.0.1:$DASHBOARD_PORT <submission id>   (checkpoints, then exits)"
