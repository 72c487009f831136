#!/usr/bin/env bash
# GPU bring-up: the GPU test tier and the GPU figures, on a machine with one CUDA device and xscale's
# dependencies installed. Writes logs to ${OUT:-gpu_bring_up}/. Phases: tests | train | ops | plan | fp8 | all.
#   bash tests/gpu/bring_up.sh all
set -u
OUT=${OUT:-gpu_bring_up}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
phase=${1:-all}
run() {  # run NAME COMMAND...: the command's output to $OUT/NAME.txt and to the terminal, with its time
  local name=$1; shift
  echo "== $name: $*" | tee "$OUT/$name.txt"
  local start=$SECONDS
  "$@" 2>&1 | tee -a "$OUT/$name.txt"
  echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - start)) s" | tee -a "$OUT/$name.txt"
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nvidia-smi -L
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
} 2>&1 | tee "$OUT/device.txt"
workers=()  # pytest-xdist, where installed, spreads the tier over 8 processes sharing the GPU (~4 min)
if python3 -c "import xdist" 2>/dev/null; then workers=(-n 8); fi
if [[ $phase == tests || $phase == all ]]; then
  run pytest timeout "${TESTS_TIMEOUT:-0}" python3 -m pytest -m gpu tests/gpu -q -rfE -p no:cacheprovider "${workers[@]}" --timeout 900
fi
limit=${BENCH_TIMEOUT:-0}  # seconds per benchmark, 0: none
if [[ $phase == train || $phase == all ]]; then
  run bench_train_gpt2 timeout "$limit" python3 -m xscale bench train --device cuda --precision bf16 --layers 12 \
    --width 768 --heads 12 --vocab 50304 --batch 8 --seq 1024 --steps 10 --warmup 3
  for mode in eager compiled; do  # the ~1B decoder, eager, then each block of both models compiled
    flags=(); [[ $mode == compiled ]] && flags=(--compile)
    run "bench_train_1b_$mode" timeout "$limit" python3 -m xscale bench train --device cuda --precision bf16 \
      --layers 24 --width 2048 --heads 16 --vocab 32000 --batch 4 --seq 2048 --steps 10 --warmup 3 \
      "${flags[@]}"
  done
fi
if [[ $phase == ops || $phase == all ]]; then
  run bench_kernels timeout "$limit" python3 -m xscale bench kernels --device cuda --dtype bf16 --csv "$OUT/kernels.csv"
  # the head's GEMMs at an aligned vocabulary (50304 = 786 x 64) beside GPT-2's odd 50257 above: how much of the
  # cross-entropy row is cuBLAS on unaligned rows (the eager reference) and what the padded logits buffer leaves
  run bench_kernels_ce_aligned timeout "$limit" python3 -m xscale bench kernels --device cuda --dtype bf16 \
    --ops linear_cross_entropy --vocab 50304
  # issue 47: the default chunk (667 tokens at vocab 50304) leaves dh = dlogits W a 667 x 768 output over K = 50304,
  # a few dozen output tiles on 132 SMs; larger chunks trade the memory advantage (target >= 3x) for full GEMMs
  for chunk in 2048 4096; do
    run "bench_kernels_ce_chunk$chunk" timeout "$limit" python3 -m xscale bench kernels --device cuda --dtype bf16 \
      --ops linear_cross_entropy --vocab 50304 --ce-chunk-tokens "$chunk"
  done
  # the memory-bound ops at 8x the tokens (100-800 MB a pass): past the launch overhead that bounds them at 8192
  run bench_kernels_large timeout "$limit" python3 -m xscale bench kernels --device cuda --dtype bf16 --tokens 65536 \
    --ops rms_norm,rms_norm_residual,layer_norm_residual,swiglu,geglu,rope,moe_permute --csv "$OUT/kernels_large.csv"
  run bench_attention timeout "$limit" python3 -m xscale bench attention --device cuda \
    --gpu-lengths "${ATTENTION_LENGTHS:-4096,8192,16384,32768,65536}" --out "$OUT/attention"
  run bench_moe timeout "$limit" python3 -m xscale bench moe --device cuda --ep 1 --dtype bf16
fi
if [[ $phase == fp8 || $phase == all ]]; then
  # fp8 (torchao float8 linears) against bf16 on the ~1.3B bench model (GPT-2-shaped, 24 x 2048, 16 heads, vocab
  # 32000, 4 x 2048 tokens), both with compiled blocks, the same copy-task data and steps: tokens/s and loss.
  # Needs torchao, which the lent H200's image lacks (torch 2.11 there): carry a wheel of the matching release, e.g.
  # pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 -d .whl
  # torchao==0.17.0, then install it there with --no-index --target /tmp/site (.library/device/README.md)
  run bench_fp8 timeout "$limit" python3 -m xscale bench fp8 configs/gpt2-small.yaml model.vocab_size=32000 \
    model.d_model=2048 model.n_layers=24 model.n_heads=16 model.max_seq_len=2048 model.dropout=0.0 \
    train.seq_len=2048 train.global_batch_size=4 train.micro_batch_size=4 train.lr=3e-4 train.warmup_steps=20 \
    data.dataset=copy --steps "${FP8_STEPS:-200}" --warmup 10 --tail 20 --compile --out "$OUT/fp8"
fi
if [[ $phase == plan || $phase == all ]]; then
  # The planner's GPU preset calibrated on this device (GEMM rates, memory bandwidth and memory measured; links and
  # the rest from the base; well under a minute), then its prediction of the ~1.3B bench model (bench_train_1b_*
  # above: GPT-2-shaped, 24 x 2048, 16 heads, vocab 32000, 4 x 2048 tokens, bf16) on one device, with the
  # calibrated file and with the datasheet preset: compare the step time and memory with bench_train_1b_eager's
  # xscale row (its resident memory holds both models; the planner's figure is xscale's alone).
  base=${PLAN_BASE:-configs/clusters/h200-ib.yaml}
  calibrated="$OUT/$(basename "$base" .yaml)-calibrated.yaml"
  run plan_calibrate timeout "$limit" python3 -m xscale plan --calibrate "$calibrated" \
    --device "${PLAN_DEVICE:-cuda}" --base "$base"
  bench_1b=(model.vocab_size=32000 model.d_model=2048 model.n_layers=24 model.n_heads=16 model.max_seq_len=2048
    model.dropout=0.0 train.seq_len=2048 train.global_batch_size=4 train.micro_batch_size=4 data.dataset=copy)
  for cluster in "$calibrated" "$base"; do
    run "plan_1b_$(basename "$cluster" .yaml)" timeout "$limit" python3 -m xscale plan configs/gpt2-small.yaml \
      "${bench_1b[@]}" --cluster "$cluster" --devices 1 --top 3
  done
fi
