#!/usr/bin/env bash
# The flywheel on the tiny default (docs/flywheel.md): serve -> collect -> curate -> train -> gate -> ship, twice.
#
# A weak run (round 0) is served with a reward model scoring its live answers; Locust users send prompts of the
# built-in task's traffic split (no training, validation or test prompt) with no answers; each round turns the
# current model's records into training data (`verl data from-records`): the prompts, and pairs of answers the users
# rated differently, which refresh the reward model; it then trains the next model from the current one on that
# reward model's scores (GRPO: groups sampled and scored at train time), checks it on held-out prompts, and ships it
# with `verl ship` against the model serving the route. The loop never reads the rule's answers: it learns from the
# reward model and the users' feedback alone. The rule only measures each round (held-out accuracy on
# builtin:arithmetic/test) and gates the release (verl ship's offline gate refuses a round that got worse).
#
#   bash examples/flywheel.sh                 # ~8-9 minutes on 2 cores; everything under outputs/flywheel
#   SEED=2 RM0=outputs/verl-rm/rm-a/checkpoints/global_step_700 bash examples/flywheel.sh   # another seed, the README's RM
#   ROUNDS=3 REQUESTS=6000 bash examples/flywheel.sh
set -euo pipefail

OUT=${OUT:-outputs/flywheel}
PORT=${PORT:-8000}
KEY=${KEY:-change-me}
ROUNDS=${ROUNDS:-2}
REQUESTS=${REQUESTS:-3000}   # requests the current model answers before each round trains (~45 s on an idle 2-core box):
                             # counted, not timed, so a slower or busier machine collects as much data
WAIT_S=${WAIT_S:-900}        # ... or the round fails after this long, saying how many came
STEPS=${STEPS:-5}            # GRPO steps per round: few, so a round stops short of what the reward model can tell apart
SEED=${SEED:-1}              # the GRPO runs' trainer.seed (sampling and batches); traffic and reward models are seeded apart
RM0=${RM0:-}                 # a reward model trained as the README's (outputs/verl-rm/rm-a/checkpoints/global_step_700):
                             # round 0 starts from it instead of training the same one again (~3 min)
URL=http://127.0.0.1:$PORT
mkdir -p "$OUT"
trap 'kill ${LOAD:-} ${SERVER:-} 2> /dev/null || true' EXIT

say() { printf '\n== %s\n' "$*"; }
# answered MODEL SINCE: the requests MODEL answered without an error (the service's records) since epoch time SINCE.
answered() {
    python - "$OUT/records.jsonl" "$1" "$2" <<'PYEOF'
import json, sys
path, model, since = sys.argv[1], sys.argv[2], float(sys.argv[3])
tag, n = f'"model": "{model}",', 0
try:
    with open(path, encoding="utf-8") as lines:
        for line in lines:  # the cheap test first: the file holds every model's requests and rewards
            if tag in line and '"kind": "request"' in line:
                row = json.loads(line)
                n += row["model"] == model and row["kind"] == "request" and row["time"] >= since and not row["error"]
except FileNotFoundError:
    pass
print(n)
PYEOF
}
accuracy() { python -c "import json,sys; print(json.load(open(sys.argv[1]))['metrics']['eval/accuracy']['value'])" "$1"; }

say "round 0: a weak run (4 GRPO steps) and a reward model trained offline on the warm start's own answers"
verl train trainer.seed="$SEED" trainer.total_steps=4 trainer.save_freq=4 trainer.test_freq=0 trainer.val_before_train=false \
    trainer.output_dir="$OUT" trainer.experiment_name=round0 --quiet
if [ -n "$RM0" ]; then
    RM=$RM0
else
    verl data pairs --model builtin:tiny-arith --out "$OUT/pairs" --max-prompts 3000 --n 4
    verl rm --config configs/rm_tiny.yaml "data.train_files=[$OUT/pairs/train.parquet,builtin:arithmetic/pairs_train]" \
        "data.val_files=[$OUT/pairs/val.parquet]" trainer.output_dir="$OUT" trainer.experiment_name=judge --quiet
    RM=$OUT/verl-rm/judge/checkpoints/global_step_700
fi
current=round0
CKPT=$OUT/verl/round0/checkpoints/global_step_4
verl eval --ckpt "$CKPT" --data builtin:arithmetic/test --out "$OUT/round0/eval" --quiet
echo "round 0: held-out accuracy $(accuracy "$OUT/round0/eval/results.json")"

cat > "$OUT/serve.yaml" <<EOF
models:
  - {name: round0, path: $CKPT}
  - {name: judge, path: $RM, kind: reward}
routes: {default: {round0: 1.0}}
score_traffic: {scorer: judge}   # the reward model scores every answer in the background
record_texts: true               # prompts and answers in the records: what from-records turns into training data
records_path: $OUT/records.jsonl
admin_api_key: $KEY
feedback_rate_limit: 1000        # one load generator is one caller
EOF
verl serve --config "$OUT/serve.yaml" --port "$PORT" > "$OUT/serve.log" 2>&1 & SERVER=$!
for _ in $(seq 300); do curl -sf "$URL/health" > /dev/null && break; sleep 1; done
# The users: while a round collects its traffic and while verl ship's canary runs. They pause while the next model
# trains: what the serving model answers then is not the round's data, and on a small machine their load would take
# the CPU the training needs.
users() {
    locust -f loadtest/ --headless -H "$URL" --user-mix feedback -u 4 -r 4 --temperature 1 --run-time 2h \
        --only-summary >> "$OUT/locust.log" 2>&1 & LOAD=$!
}
pause_users() { kill "$LOAD"; wait "$LOAD" 2> /dev/null || true; LOAD=; }
users

for round in $(seq 1 "$ROUNDS"); do
    say "round $round: $REQUESTS requests of $current's traffic -> training data -> GRPO from $current -> verl ship"
    since=$(date +%s) waited=0
    while [ "$(answered "$current" "$since")" -lt "$REQUESTS" ]; do
        if [ "$waited" -ge "$WAIT_S" ]; then
            echo "error: $current answered $(answered "$current" "$since") of $REQUESTS requests in $WAIT_S s;" \
                "$OUT/locust.log and $OUT/serve.log say why (lower REQUESTS or raise WAIT_S)" >&2
            exit 1
        fi
        sleep 5; waited=$((waited + 5))
    done
    echo "round $round: $current answered $(answered "$current" "$since") requests in $waited s"
    pause_users
    verl data from-records "$OUT/records.jsonl" --out "$OUT/round$round/data" --model "$current" \
        --reward-source rm:judge --val-fraction 0.1
    # The users' thumbs on the same answers: pairs (a right and a wrong answer to one prompt) that refresh the reward
    # model on what the current model gets wrong, so the next policy cannot game what the last one learnt.
    verl data from-records "$OUT/records.jsonl" --out "$OUT/round$round/feedback" --model "$current" \
        --reward-source feedback --val-fraction 0.2
    verl rm --config configs/rm_tiny.yaml model.path="$RM" \
        "data.train_files=[$OUT/round$round/feedback,builtin:arithmetic/pairs_train]" \
        "data.val_files=[$OUT/round$round/feedback]" optim.lr=3e-4 optim.warmup_steps=5 trainer.total_steps=100 \
        trainer.test_freq=100 trainer.output_dir="$OUT" trainer.experiment_name="judge$round" --quiet
    RM=$OUT/verl-rm/judge$round/checkpoints/global_step_100
    verl train trainer.seed="$SEED" model.path="$CKPT" "data.train_files=[$OUT/round$round/data]" reward.model.path="$RM" \
        trainer.total_steps="$STEPS" trainer.save_freq="$STEPS" \
        trainer.test_freq="$STEPS" trainer.val_before_train=false trainer.output_dir="$OUT" \
        trainer.experiment_name="round$round" --quiet
    next=$OUT/verl/round$round/checkpoints/global_step_$STEPS
    verl eval --ckpt "$next" --data builtin:arithmetic/test --out "$OUT/round$round/eval" --quiet
    verl compare "$OUT/round$((round - 1))/eval" "$OUT/round$round/eval" --out "$OUT/round$round/compare" --quiet
    echo "round $round: held-out accuracy $(accuracy "$OUT/round$((round - 1))/eval/results.json") -> $(accuracy "$OUT/round$round/eval/results.json") (report: $OUT/round$round/compare/report.md)"
    # Promoted (exit 0), the next round learns from the new model's traffic; refused or rolled back (exit 10), the
    # serving model keeps the route and the next round starts from it again. The users are back for the canary.
    users
    if verl ship "$OUT/verl/round$round" --ckpt "$next" --name "round$round" --service "$URL" --admin-key "$KEY" \
        --reward-source rm:judge --capacity-users 2 --capacity-s 6 --budget-s 300 --out "$OUT/round$round/ship"; then
        current=round$round
        CKPT=$next
    else
        status=$?
        [ "$status" -eq 10 ] || exit "$status"   # 10: refused or rolled back; anything else is a failure
        echo "round $round: not shipped: $current keeps the route ($OUT/round$round/ship/ship_report.md says why)"
    fi
done
say "$current serves the route; every round's evidence is under $OUT/round*/"
