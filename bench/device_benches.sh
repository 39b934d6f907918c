# One device call (<= 10 minutes) per part. Each prints its table last and leaves JSON/PNG under $OUT.
#   . bench/device_setup.sh && bash bench/device_benches.sh [PART]
#   serve (default): the serving path against the in-process engine on the Llama-3-8B shape (issue 41),
#       then structured outputs' decode-step cost at batch 64 (issue 38)
#   disagg: issue 37: TTFT of `serve --pools disaggregated` (KV by NIXL: the repacked wheel in .whl/)
#       against unified, 8k-token prompts of the Llama-3-8B shape, C = 1 and 4 (bench/disagg_ttft.py;
#       on one GPU the disaggregated rows say "skipped" with serve's placement error: docs/performance.md
#       says why). Set NO_FLASHINFER=1 for device_setup.sh: FlashInfer's JIT builds take minutes.
set -u
OUT=${OUT:-bench/results}
PART=${1:-serve}
case "$PART" in
    serve)
        timeout 450 python3 -m bench.serve_vs_offline --device cuda --shape llama3-8b --deadline 380 --out "$OUT" \
            2>&1 | tail -40
        timeout 100 python3 -m bench.structured_outputs --device cuda --dtype bfloat16 --rounds 4 --tag h200 \
            2>&1 | tail -20
        cp bench/results/structured_outputs-h200.* "$OUT"/ 2>/dev/null || true ;;
    disagg)
        timeout 540 python3 -m bench.disagg_ttft --device cuda --shape llama3-8b --deadline 300 --out "$OUT" \
            --logs "$OUT" 2>&1 | tail -30 ;;
    *) echo "unknown part $PART (serve or disagg)"; exit 2 ;;
esac
