#!/usr/bin/env bash
# make demo: a one-node Ray cluster on 127.0.0.1, the rollout app deployed from serve_config.yaml,
# the FlowGRPO trainer against it by DeploymentHandle, and the cluster stopped again on exit,
# Ctrl-C or error.
#   STEPS=30 OUT=outputs/demo scripts/demo.sh [trainer overrides...]
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
BIN=$(dirname "$PY")
STEPS=${STEPS:-30}
OUT=${OUT:-outputs/demo-$(date +%Y%m%d-%H%M%S)}
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1
# FLOWGRPO_HOME (models, weight versions) is inherited by the Ray workers started below, so the
# replicas and the trainer share one weight store.

free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
PORT=$(free_port)
DASHBOARD_PORT=$(free_port)
SERVE_ADDR=http://127.0.0.1:$DASHBOARD_PORT
# Our own temp dir, so `ray stop` and the trainer's address="auto" only ever see this cluster.
OWN_TMPDIR=
if [ -z "${RAY_TMPDIR:-}" ]; then RAY_TMPDIR=$(mktemp -d /tmp/flowgrpo-ray.XXXXXX); OWN_TMPDIR=$RAY_TMPDIR; fi
export RAY_TMPDIR
RAY_PID=
cleanup() {
  # `ray start --block` stops exactly the processes it started when signalled; unlike a bare
  # `ray stop` this leaves any other Ray cluster on the machine alone.
  if [ -n "$RAY_PID" ]; then
    echo "demo: stopping the Ray cluster on 127.0.0.1:$PORT"
    kill -TERM "$RAY_PID" 2>/dev/null || true
    wait "$RAY_PID" 2>/dev/null || true
  fi
  if [ -n "$OWN_TMPDIR" ]; then rm -rf "$OWN_TMPDIR"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

echo "demo: building the embedded model (once)"
"$PY" -c 'from serve_app.models import ensure_embedded_model; ensure_embedded_model("tiny-qwen-image")'
# Validate the trainer config before starting anything.
"$PY" -c 'import sys; from serve_app.trainer.config import load_trainer_config; load_trainer_config("trainer/flowgrpo", sys.argv[1:])' "$@"

echo "demo: starting Ray on 127.0.0.1:$PORT"
"$BIN/ray" start --head --block --num-cpus 2 --node-ip-address 127.0.0.1 --port "$PORT" \
  --dashboard-host 127.0.0.1 --dashboard-port "$DASHBOARD_PORT" --disable-usage-stats --temp-dir "$RAY_TMPDIR" \
  >"$RAY_TMPDIR/ray-start.log" 2>&1 &
RAY_PID=$!
export RAY_ADDRESS=127.0.0.1:$PORT
# `serve deploy` talks to the dashboard's REST API, which comes up after the GCS: wait for it.
dashboard_up() {
  "$PY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' "$SERVE_ADDR/api/ray/version" 2>/dev/null
}
for _ in $(seq 1 120); do
  dashboard_up && break
  kill -0 "$RAY_PID" 2>/dev/null || { cat "$RAY_TMPDIR/ray-start.log"; exit 1; }
  sleep 1
done
dashboard_up || { echo "demo: the Ray dashboard did not come up"; cat "$RAY_TMPDIR/ray-start.log"; exit 1; }

echo "demo: deploying serve_config.yaml"
"$BIN/serve" deploy --address "$SERVE_ADDR" serve_config.yaml
for _ in $(seq 1 120); do
  status=$("$BIN/serve" status --address "$SERVE_ADDR" 2>/dev/null || true)
  if echo "$status" | grep -q "status: RUNNING" && ! echo "$status" | grep -qE "status: (DEPLOYING|DEPLOY_FAILED|UNHEALTHY)"; then
    break
  fi
  if echo "$status" | grep -q "DEPLOY_FAILED"; then echo "$status"; exit 1; fi
  sleep 2
done
echo "$status" | grep -q "status: RUNNING" || { echo "demo: the app did not reach RUNNING"; echo "$status"; exit 1; }

echo "demo: training $STEPS steps -> $OUT"
"$PY" -m serve_app.trainer --config trainer/flowgrpo --steps "$STEPS" --out "$OUT" --address "$RAY_ADDRESS" "$@"
echo "demo: metrics in $OUT/metrics.csv, curve in $OUT/reward_curve.png"
