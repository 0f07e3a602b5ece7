#!/usr/bin/env bash
# make demo: a one-node Ray cluster on 127.0.0.1, the rollout app deployed from serve_config.yaml,
# the FlowGRPO trainer against it by DeploymentHandle (TRANSPORT=http: over the app's HTTP API alone, with
# a bearer token made for the run), and the cluster stopped again on exit, Ctrl-C or error.
#   WORLD=shapes STEPS=100 OUT=outputs/demo TRANSPORT=handle ALGO=flow_grpo scripts/demo.sh [trainer overrides...]
# ALGO: a file of configs/algorithm/ (flow_grpo, mix_grpo, dance_grpo, diffusion_nft, grpo_guard).
# WORLD=shapes (default): the pretrained shapes-world model learns to draw what the prompt asks
# (held-out strict accuracy in eval.csv); WORLD=video: the pretrained moving-shapes Wan model learns
# to move its shape the way the prompt asks (direction accuracy in eval.csv); WORLD=edit: the pretrained
# Qwen-Image-Edit model learns to edit a scene as its instruction asks (held-out strict accuracy in
# eval.csv); WORLD=brightness: the random tiny model, brightness reward.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
BIN=$(dirname "$PY")
STEPS=${STEPS:-}  # empty: the trainer config's trainer.steps
WORLD=${WORLD:-shapes}
TRANSPORT=${TRANSPORT:-handle}
ALGO=${ALGO:-flow_grpo}
if [ ! -f "configs/algorithm/$ALGO.yaml" ]; then
  echo "demo: unknown ALGO=$ALGO ($(cd configs/algorithm && ls *.yaml | sed 's/\.yaml$//' | paste -sd, -))"; exit 2
fi
# The algorithm's settings (configs/algorithm/$ALGO.yaml) come before the caller's overrides, which win.
set -- "algorithm=$ALGO" "$@"
case "$TRANSPORT" in handle|http) ;; *) echo "demo: unknown TRANSPORT=$TRANSPORT (handle or http)"; exit 2 ;; esac
case "$WORLD" in
  shapes) APP_CONFIG=shapes_rollout; TRAINER_CONFIG=trainer/shapes ;;
  video) APP_CONFIG=motion_rollout; TRAINER_CONFIG=trainer/motion ;;
  edit) APP_CONFIG=edit_rollout; TRAINER_CONFIG=trainer/edit ;;
  brightness) APP_CONFIG=diffusion_rollout; TRAINER_CONFIG=trainer/flowgrpo ;;
  *) echo "demo: unknown WORLD=$WORLD (shapes, video, edit or brightness)"; exit 2 ;;
esac
OUT=${OUT:-outputs/demo-$(date +%Y%m%d-%H%M%S)}
# On loopback, with token authentication (a fresh token per run unless one is given): see
# serve_app/local_ray.py for why both matter.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=token RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1
export RAY_AUTH_TOKEN=${RAY_AUTH_TOKEN:-$("$PY" -c 'import secrets; print(secrets.token_hex(32))')}
# FLOWGRPO_HOME (models, weight versions) is inherited by the Ray workers started below, so the
# replicas and the trainer share one weight store.

# Below the kernel's ephemeral range, which Ray's own servers draw from as the cluster starts.
free_port() { "$PY" -c 'from serve_app.local_ray import free_loopback_port; print(free_loopback_port())'; }
PORT=$(free_port)
DASHBOARD_PORT=$(free_port)
HTTP_PORT=$(free_port)
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

echo "demo: $WORLD world (app config $APP_CONFIG, trainer config $TRAINER_CONFIG, algorithm $ALGO)"
# Validate the trainer config and build (once) the model it names before starting anything.
"$PY" - "$TRAINER_CONFIG" "$@" <<'PYEOF'
import sys
from serve_app.policies import model_dir
from serve_app.trainer.config import load_trainer_config
print("demo: model at", model_dir(load_trainer_config(sys.argv[1], sys.argv[2:]).model))
PYEOF

echo "demo: starting Ray on 127.0.0.1:$PORT"
"$BIN/ray" start --head --block --num-cpus 2 --node-ip-address 127.0.0.1 --port "$PORT" \
  --dashboard-host 127.0.0.1 --dashboard-port "$DASHBOARD_PORT" --disable-usage-stats --temp-dir "$RAY_TMPDIR" \
  >"$RAY_TMPDIR/ray-start.log" 2>&1 &
RAY_PID=$!
export RAY_ADDRESS=127.0.0.1:$PORT
# `serve deploy` talks to the dashboard's REST API, which comes up after the GCS: wait for it.
dashboard_up() {
  "$PY" -c 'import os, sys, urllib.request
request = urllib.request.Request(sys.argv[1], headers={"authorization": "Bearer " + os.environ["RAY_AUTH_TOKEN"]})
urllib.request.urlopen(request, timeout=2)' "$SERVE_ADDR/api/ray/version" 2>/dev/null
}
for _ in $(seq 1 120); do
  dashboard_up && break
  kill -0 "$RAY_PID" 2>/dev/null || { cat "$RAY_TMPDIR/ray-start.log"; exit 1; }
  sleep 1
done
dashboard_up || { echo "demo: the Ray dashboard did not come up"; cat "$RAY_TMPDIR/ray-start.log"; exit 1; }

echo "demo: deploying serve_config.yaml with app config $APP_CONFIG"
DEPLOY_FILE=$RAY_TMPDIR/serve_config.$WORLD.yaml
# The HTTP API's bearer token, in a file the ingress reads (never in the config itself).
TOKEN_FILE=$RAY_TMPDIR/api_token
"$PY" -c 'import secrets; print(secrets.token_hex(32))' > "$TOKEN_FILE"
"$PY" - "$APP_CONFIG" "$DEPLOY_FILE" "$HTTP_PORT" "$TOKEN_FILE" <<'PYEOF'
import sys, yaml
deploy = yaml.safe_load(open("serve_config.yaml"))
deploy["http_options"]["port"] = int(sys.argv[3])
args = deploy["applications"][0]["args"]
args["config"] = sys.argv[1]
args["overrides"] = [*args.get("overrides", []), f"ingress.api_token_file={sys.argv[4]}"]
yaml.safe_dump(deploy, open(sys.argv[2], "w"), sort_keys=False)
PYEOF
"$BIN/serve" deploy --address "$SERVE_ADDR" "$DEPLOY_FILE"
for _ in $(seq 1 120); do
  status=$("$BIN/serve" status --address "$SERVE_ADDR" 2>/dev/null || true)
  if echo "$status" | grep -q "status: RUNNING" && ! echo "$status" | grep -qE "status: (DEPLOYING|DEPLOY_FAILED|UNHEALTHY)"; then
    break
  fi
  if echo "$status" | grep -q "DEPLOY_FAILED"; then echo "$status"; exit 1; fi
  sleep 2
done
echo "$status" | grep -q "status: RUNNING" || { echo "demo: the app did not reach RUNNING"; echo "$status"; exit 1; }

echo "demo: training ${STEPS:-trainer.steps of $TRAINER_CONFIG} steps by $TRANSPORT -> $OUT"
if [ "$TRANSPORT" = http ]; then
  "$PY" -m serve_app.trainer --config "$TRAINER_CONFIG" ${STEPS:+--steps "$STEPS"} --out "$OUT" \
    --url "http://127.0.0.1:$HTTP_PORT" --token-file "$TOKEN_FILE" "$@"
else
  "$PY" -m serve_app.trainer --config "$TRAINER_CONFIG" ${STEPS:+--steps "$STEPS"} --out "$OUT" --address "$RAY_ADDRESS" "$@"
fi
echo "demo: metrics in $OUT/metrics.csv, curve in $OUT/reward_curve.png"
if [ -f "$OUT/eval.csv" ]; then
  echo "demo: evaluations in $OUT/eval.csv and the pictures $(cd "$OUT" && ls eval_accuracy.png eval_before*.png eval_after*.png 2>/dev/null | tr '\n' ' ')"
fi
