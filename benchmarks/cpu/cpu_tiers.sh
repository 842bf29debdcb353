#!/usr/bin/env bash
# Every CPU benchmark on each CPU tier this machine can run, one after another (never
# two at once on a 2-core machine). The lower tiers are emulated on a better CPU:
#   avx2:  ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 (no AVX512; bf16 emulated, ~30-70x
#          slower than float32);
#   avx512: ATEN_CPU_CAPABILITY=avx512 ONEDNN_MAX_CPU_ISA=AVX512_CORE (AVX512 without its bf16
#          instructions, as Skylake/Cascade Lake Xeons: oneDNN converts bf16 to float32, a bf16
#          matmul ~2-3x slower than float32; only on a CPU with AVX512);
#   native: whatever this CPU has (AVX512, AVX512-BF16 or AMX).
# Each emulation is checked below with torch's reported capability and a timed bf16 matmul
# against float32.
# Each tier gets its own TORCHINDUCTOR_CACHE_DIR (kernels compiled for one ISA gave wrong numbers
# when reused under another); the speed-choice cache is keyed by the CPU's capability already.
#
#   benchmarks/cpu/cpu_tiers.sh --nanogpt /path/to/nanoGPT            # every tier, every benchmark
#   benchmarks/cpu/cpu_tiers.sh --nanogpt DIR --tiers avx2 --only race
#   benchmarks/cpu/cpu_tiers.sh --nanogpt DIR --tiers native,avx512,avx2     # avx512: an AVX512 CPU
#
# Benchmarks: throughput (bench_nanogpt.py: gptrain bench vs nanoGPT's train.py), race
# (bench_race.py: configs/race.toml vs nanoGPT's README CPU recipe, whole processes), train
# (bench_race.py on configs/default.toml: what `make train` runs, <= 5 min to <= 2.60), startup
# (the measured speed choices: first run and cached). Results go to stdout as markdown tables.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
NANOGPT="" ONLY="throughput,race,train,startup"
# the default tiers: native, and each lower one this CPU can emulate (avx512: where the native one
# has bf16 instructions on top of AVX512)
if grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo; then TIERS="native,avx512,avx2"; else TIERS="native,avx2"; fi
while [ $# -gt 0 ]; do
  case "$1" in
    --nanogpt) NANOGPT=$2; shift 2 ;;
    --tiers) TIERS=$2; shift 2 ;;
    --only) ONLY=$2; shift 2 ;;
    *) echo "cpu_tiers.sh: unknown argument $1 (use --nanogpt DIR, --tiers native,avx512,avx2, --only LIST)" >&2; exit 2 ;;
  esac
done
TEXT=../shared/data/tinyshakespeare/input.txt
wants() { [[ ",$ONLY," == *",$1,"* ]]; }
if { wants throughput || wants race; } && [ ! -f "$NANOGPT/train.py" ]; then
  echo "cpu_tiers.sh: throughput and race need --nanogpt DIR (a nanoGPT checkout with train.py)" >&2
  exit 2
fi

for tier in ${TIERS//,/ }; do
  case "$tier" in
    native) envs=() ;;
    avx2) envs=(ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2) ;;
    avx512)
      if ! grep -qw avx512f /proc/cpuinfo; then
        echo "cpu_tiers.sh: tier avx512 needs a CPU with AVX512 (this one has none); use --tiers native,avx2" >&2
        exit 2
      fi
      envs=(ATEN_CPU_CAPABILITY=avx512 ONEDNN_MAX_CPU_ISA=AVX512_CORE) ;;
    *) echo "cpu_tiers.sh: unknown tier $tier (native, avx512, avx2)" >&2; exit 2 ;;
  esac
  scratch=$(mktemp -d)
  envs+=(TORCHINDUCTOR_CACHE_DIR="$scratch/inductor" PYTHONPATH=.)
  run() { env "${envs[@]}" "$@"; }
  echo "## tier: $tier ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs))"
  run "$PY" - <<'EOF'
import time, torch
a = torch.randn(512, 512)
t = {}
for dt in (torch.float32, torch.bfloat16):
    x = a.to(dt); x @ x
    t0 = time.perf_counter(); [x @ x for _ in range(3)]; t[dt] = (time.perf_counter() - t0) / 3
print(f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, "
      f"512^3 matmul float32 {t[torch.float32] * 1e3:.2f} ms, bf16 {t[torch.bfloat16] * 1e3:.2f} ms "
      f"({t[torch.bfloat16] / t[torch.float32]:.1f}x)")
EOF
  if wants startup; then
    echo "### start-up: the measured speed choices (race and default shapes), first run then cached"
    run "$PY" -m gptrain prepare --input "$TEXT" --out "$scratch/data" --no-progress > /dev/null
    for config in race default; do
      for attempt in first cached; do
        echo "$config, $attempt run:"
        run env GPTRAIN_CACHE="$scratch/cache" "$PY" -m gptrain train --config "configs/$config.toml" \
          --data.dir="$scratch/data" --train.max_steps=1 --optim.warmup_steps=0 --eval.every=0 --eval.tokens=65536 \
          --eval.sample_every=0 --checkpoint.every=0 --run.dir="$scratch/startup-$config-$attempt" \
          --log.progress=false 2>&1 | grep -o "speed choices in [^;]*" | cut -c1-160 || true
      done
    done
  fi
  if wants throughput; then
    echo "### throughput: gptrain bench vs nanoGPT train.py (bench shapes)"
    run "$PY" benchmarks/cpu/bench_nanogpt.py --nanogpt "$NANOGPT" --input "$TEXT" --rounds 2
  fi
  if wants race; then
    echo "### race: configs/race.toml vs nanoGPT's README CPU recipe (whole processes)"
    run "$PY" benchmarks/cpu/bench_race.py --config configs/race.toml --input "$TEXT" --target 2.72 \
      --nanogpt "$NANOGPT" || true
  fi
  if wants train; then
    echo "### make train: configs/default.toml (<= 2.60 in <= 300 s)"
    run "$PY" benchmarks/cpu/bench_race.py --config configs/default.toml --target 2.60 --limit-s 300 || true
  fi
  rm -rf "$scratch"
done
