#!/usr/bin/env bash
# The GPU table of docs/benchmarks.md, as one script: tune the bundled demo heads on this machine (into a
# copy), then time every contender at batch 1 and the batched throughput. Run from the repository root:
#   OUT=runs/gpu bash docs/gpu_bench.sh            (DEVICE=cpu runs the same steps on the CPU)
# Each step has a time limit so that a slow step cannot take the later ones with it.
set -o pipefail
OUT=${OUT:-runs/gpu}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
log="$OUT/run.log"
S="python3 -m selfspec.cli.main"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || echo "no nvidia-smi"
  python3 -c "import sys, torch, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$log"
python3 -c "
import torch
if torch.cuda.is_available():  # does torch's int8 weight-only kernel (the int8 draft head) run on this GPU?
    x = torch.randn(1, 256, device='cuda', dtype=torch.bfloat16)
    w = torch.randint(-127, 127, (512, 256), dtype=torch.int8, device='cuda')
    try:
        torch._weight_int8pack_mm(x, w, torch.ones(512, device='cuda', dtype=torch.bfloat16))
        print('int8 weight-only matmul: runs on cuda')
    except Exception as error:
        print('int8 weight-only matmul on cuda:', type(error).__name__, str(error)[:200])
" 2>&1 | tee -a "$log"
work=$(mktemp -d)
cp -r heads/demo-target "$work/demo-target"
target="$work/demo-target"
heads=(--heads "$target/exit-heads" --heads "$target/medusa-heads")
step() {  # step SECONDS TITLE COMMAND...
  local limit=$1 title=$2; shift 2
  echo -e "\n## $title\n\$ ${*#python3 -m selfspec.cli.main }" | tee -a "$log"
  local start=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee -a "$log"
  echo "(exit ${PIPESTATUS[0]}, $((SECONDS - start)) s)" | tee -a "$log"
}
step 200 "tune" $S tune --model "$target" "${heads[@]}" --device "$DEVICE" --num_prompts 4 --batch_sizes 1,4,16,64
step 330 "bench, batch 1" $S bench --model "$target" "${heads[@]}" --device "$DEVICE" --repeats 1 --output "$OUT"
step 120 "bench, batched" $S bench --model "$target" "${heads[@]}" --device "$DEVICE" --repeats 1 \
  --batch_sizes 1,4,16,64 --output "$OUT"
for kind in exit-heads medusa-heads; do cp "$target/$kind/config.json" "$OUT/tuned_$kind.json"; done
