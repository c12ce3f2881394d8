#!/usr/bin/env bash
# The README's quick start on one machine: three daemons on loopback (own data dirs and ports,
# one swarm key, one corpus), a run started from the second, followed from the third, a peer
# killed and restarted, the run stopped, resumed, finished, exported and loaded in transformers.
# Prints each step's wall time. Needs `dtfm-peer` on PATH (the clone's .venv/bin); transformers
# for the load (skipped without it). docs/walkthrough.md has a run's figures.
#
#   PATH=$PWD/.venv/bin:$PATH bench/walkthrough.sh [WORK_DIR] [STEPS]
set -u
SRC=$(cd "$(dirname "$0")/.." && pwd)
W=${1:-$(mktemp -d /tmp/dtfm-walk.XXXX)}; STEPS=${2:-300}; BASE=${PORT_BASE:-17450}
mkdir -p "$W" && cd "$W" || exit 1
PY=$(dirname "$(command -v dtfm-peer)")/python
now() { date +%s.%N; }
since() { printf '%.1f' "$(echo "$(now) - $1" | bc)"; }
row() { printf '%-58s %8s s\n' "$1" "$2" | tee -a times.txt; }
wait_for() { # SECONDS FILE PATTERN [FROM_LINE]: wait until FILE (from line FROM_LINE) matches
  local end=$(( $(date +%s) + $1 )); while (( $(date +%s) < end )); do
    tail -n +"${4:-1}" "$2" 2>/dev/null | grep -qE "$3" && return 0; sleep 0.2; done
  echo "gave up waiting for /$3/ in $2" >&2; return 1; }
join() { # NAME INDEX REGION
  local bs=""; for i in 0 1 2; do [ "$i" != "$2" ] && bs="$bs --bootstrap 127.0.0.1:$((BASE + i))"; done
  dtfm-peer join --data-dir "$1" --swarm-key swarm.key --data corpus.txt --region "$3" \
    --listen 127.0.0.1:$((BASE + $2)) $bs >> "$1.log" 2>&1 &
  echo $! > "$1.pid"; }
cleanup() { for n in a b c; do [ -f $n.pid ] && kill "$(cat $n.pid)" 2>/dev/null; done
            [ -f follow.pid ] && kill "$(cat follow.pid)" 2>/dev/null; }
trap cleanup EXIT
: > times.txt

dtfm-peer swarm-key new --out swarm.key --force 2>/dev/null
cat "$SRC"/README.md "$SRC"/docs/*.md > corpus.txt

t=$(now); join a 0 eu-west; join b 1 us-east; join c 2 asia
until dtfm-peer status --data-dir a 2>/dev/null | grep -q "3 of 3 peer pairs measured"; do
  sleep 0.5; (( $(date +%s) - ${t%.*} > 180 )) && { echo "links not measured in 180 s"; exit 1; }; done
row "3 daemons joined until status shows 3 of 3 pairs measured" "$(since "$t")"

t=$(now); dtfm-peer train start --data-dir b --steps "$STEPS" --min-peers 3 2>&1 | tee start.out
row "train start --steps $STEPS --min-peers 3 (on b) answered" "$(since "$t")"
dtfm-peer train status --data-dir c --follow > follow.out 2>&1 & echo $! > follow.pid
wait_for 120 follow.out "^step 1/" && row "  ... until step 1 completed" "$(since "$t")"

wait_for 300 follow.out "^step 20/" || exit 1
from=$(wc -l < follow.out); t=$(now); kill -9 "$(cat a.pid)"
wait_for 120 follow.out "^reconfigured" "$from" && row "kill -9 a: until the reconfiguration" "$(since "$t")"
from2=$(grep -n "^reconfigured" follow.out | tail -1 | cut -d: -f1)
wait_for 120 follow.out "^step" "$from2" && row "kill -9 a: until the next completed step" "$(since "$t")"

from=$(wc -l < follow.out); t=$(now); join a 0 eu-west
until dtfm-peer members --data-dir b 2>/dev/null | grep -q "3 alive"; do sleep 0.3; done
row "restart a: until members on b says 3 alive" "$(since "$t")"
wait_for 120 follow.out "^reconfigured.*joined" "$from" && row "restart a: until the run takes it back (reconfigured)" "$(since "$t")"
dtfm-peer status --data-dir a | sed -n '/^training/,$p' > status-a-restarted.txt

t=$(now); dtfm-peer train stop --data-dir c; row "train stop (on c)" "$(since "$t")"
wait_for 120 follow.out "stopped after" && row "  ... until follow says stopped" "$(since "$t")"
kill "$(cat follow.pid)" 2>/dev/null; tail -2 follow.out

t=$(now); dtfm-peer train resume --data-dir a; row "train resume (on a)" "$(since "$t")"
dtfm-peer train status --data-dir b --follow > follow2.out 2>&1 & echo $! > follow.pid
wait_for 60 follow2.out "^step" 2 && row "  ... until the next completed step" "$(since "$t")"
wait_for 600 follow2.out "finished" && row "  ... until the run finished" "$(since "$t")"
tail -2 follow2.out

t=$(now); dtfm-peer export --data-dir c --out model --force; row "export --out model (on c)" "$(since "$t")"
t=$(now)
if "$PY" -c "import transformers" 2>/dev/null; then
  "$PY" - <<'EOF'
import torch
from transformers import GPT2LMHeadModel
m = GPT2LMHeadModel.from_pretrained("model")
torch.manual_seed(0)
out = m.generate(torch.tensor([list(b"The swarm")]), max_new_tokens=40, do_sample=True, top_k=20)
print("transformers:", repr(bytes(out[0].tolist()).decode("utf-8", "replace")))
EOF
  row "load in transformers and generate 40 tokens" "$(since "$t")"
else echo "transformers is not installed: .venv/bin/pip install transformers"; fi
t=$(now); "$PY" -m dtfm.train sample --model model --prompt "The swarm" | head -3
row "python -m dtfm.train sample --model model" "$(since "$t")"

for n in c a b; do t=$(now); dtfm-peer leave --data-dir $n; row "leave $n" "$(since "$t")"; done
echo; echo "work dir $W"; cat times.txt
