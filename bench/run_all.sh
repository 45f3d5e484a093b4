#!/usr/bin/env bash
# Every benchmark behind BENCHMARKS.md, one after another (they must not share the 2 cores).
# Usage: bash bench/run_all.sh > bench/out/run_all.log 2>&1
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
mkdir -p bench/out
echo "== probe cost";        $PY bench/bench_probe_cost.py
echo "== report scale";      (cd bench && ../$PY bench_report_scale.py)
echo "== probe overhead";    (cd bench && ../$PY bench_probe_overhead.py --model tiny --requests 64 --pairs 5)
echo "== probe cpu";         $PY bench/bench_probe_cpu.py --model tiny --requests 1024 --pairs 8
echo "== modes tiny";        (cd bench && ../$PY bench_modes.py --model tiny --requests 64 --pairs 5)
echo "== modes default";     (cd bench && ../$PY bench_modes.py --model default --requests 32 --pairs 3 --modes serial,overlap,timeslice)
echo "== long prompt";       (cd bench && ../$PY bench_long_prompt.py --model default)
echo "== engine vs hf";      $PY bench/bench_engine_vs_hf.py --repeats 1 --threads 1
