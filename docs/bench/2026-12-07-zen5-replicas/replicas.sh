#!/usr/bin/env bash
# serve --replicas R --threads T on port P, then bench-serve at 1/4/8 clients, then a killed replica's recovery
cd /work/main && source .venv/bin/activate
R=$1; T=$2; P=$3; shift 3; EXTRA="$@"
OUT=docs/bench/2026-12-07-zen5-replicas/r${R}t${T}${TAG}
specdecode serve --replicas $R --threads $T --port $P $EXTRA > $OUT.serve.log 2>&1 &
for i in $(seq 1 600); do curl -sf http://127.0.0.1:$P/health >/dev/null && break; sleep 1; done
echo "ready after $i s" > $OUT.txt
MODEL=$(curl -s http://127.0.0.1:$P/v1/models | python -c "import json,sys; print(json.load(sys.stdin)['data'][0]['id'])")
specdecode bench-serve --url http://127.0.0.1:$P --model $MODEL --clients 1 4 8 --requests-per-client 2 --max-tokens 64 >> $OUT.txt 2>&1
python - $P $MODEL >> $OUT.txt 2>&1 <<'PY'
import os, signal, sys, time, httpx
port, model = sys.argv[1], sys.argv[2]
url = f"http://127.0.0.1:{port}/v1/completions"
body = {"model": model, "prompt": "def fib(n):", "max_tokens": 8, "temperature": 0}
seen = set()
for _ in range(20):
    seen.add(httpx.post(url, json=body, timeout=300).headers["x-specdecode-replica"])
pids = [int(p) for p in os.popen("pgrep -f 'ServeReplica:specdecode'").read().split()]
victim = pids[0]
os.kill(victim, signal.SIGKILL)
t0 = time.perf_counter()
errors, new = 0, None
while new is None and time.perf_counter() - t0 < 600:
    try:
        r = httpx.post(url, json=body, timeout=300)
        if r.status_code != 200:
            errors += 1
        elif r.headers["x-specdecode-replica"] not in seen:
            new = r.headers["x-specdecode-replica"]
    except httpx.HTTPError:
        errors += 1
print(f"killed replica process {victim}; a new replica ({new}) served {time.perf_counter() - t0:.1f} s later; "
      f"{errors} requests failed meanwhile")
PY
pkill -INT -f "specdecode serve --replicas" ; sleep 5; ray stop --force >/dev/null 2>&1; pkill -f "specdecode serve --replicas"; sleep 2
