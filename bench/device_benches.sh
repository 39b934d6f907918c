# One device call (<= 10 minutes): the serving path against the in-process engine on the Llama-3-8B
# shape (issue 41), then structured outputs' decode-step cost at batch 64 (issue 38). Each prints
# its table last and leaves JSON/PNG under $OUT.
#   . bench/device_setup.sh && bash bench/device_benches.sh
set -u
OUT=${OUT:-bench/results}
timeout 450 python3 -m bench.serve_vs_offline --device cuda --shape llama3-8b --deadline 380 --out "$OUT" \
    2>&1 | tail -40
timeout 100 python3 -m bench.structured_outputs --device cuda --dtype bfloat16 --rounds 4 --tag h200 \
    2>&1 | tail -20
cp bench/results/structured_outputs-h200.* "$OUT"/ 2>/dev/null || true
