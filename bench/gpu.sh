#!/usr/bin/env bash
# Every GPU figure of docs/benchmarks.md, on a fresh GPU machine with no network, one stage a call.
#
#   bash bench/gpu.sh WHEELS OUT STAGE...
#
# WHEELS: a folder of the wheels the machine lacks (pyzmq; fla-core for the prefill kernel; llguidance; fastapi
# with starlette, pydantic, annotated-doc and opentelemetry-api, uvicorn, for the serving stages), installed
# into /tmp/shardspec-site with no index. OUT: where logs and JSON results go. Checkpoints are written
# under .bench/ (kept while the machine is). Each stage fits in ~10 minutes on 2 × H200 (9b took 6, tests 4) and
# writes at most 8 files to OUT:
#   tests   tests/test_cuda.py + tests/test_kernels.py, and the MTP tests again with NCCL only (TP = 2)
#           and the cuBLAS draft head
#   9b      9B-class, TP = 1: batch 1/8/32, MTP off and k = 1..4 at 0.6 and 0.8, prefill 2k/8k,
#           transformers' generate in the same run; the in-process batch-8 step and prefill profile;
#           the drafts' LM head (bench/lm_head.py), the delta rule's tiles (bench/gdn_tiles.py), and batch 1/8
#           MTP with the cuBLAS draft head (the peer)
#   9b-tp2  9B-class, TP = 2, batch 1/8/32, MTP off and k = 3 at 0.8: the symmetric-memory all-reduce
#           fused with the norm, the same unfused (--no-fused-norm, the peer), NCCL; and TP = 1
#           in the same call, the reference of the ratios
#   tp2-profile  the all-reduce latency table (with the add + norm paths), the in-process 9B step at
#           TP = 1 and at TP = 2 fused and unfused (with the all-reduce kernels of both ranks)
#   27b     27B-class (written first, ~1.5 min): TP = 2 (symmetric memory, fused) and TP = 1, batch
#           1/8/32, MTP off and k = 3 at 0.8; TP = 2 unfused without MTP
#   floor   one H200: tests/test_cuda.py + tests/test_kernels.py (the 9B-class checkpoint written meanwhile),
#           then 9B-class TP = 1 batch 1/8, MTP off and k = 3 at 0.8, against the floor; the drafts' LM head
#           (bench/lm_head.py, 1/2/16 rows) with its ties and wrong indices; each part runs even if one before failed
#   deterministic  tests/test_cuda.py (with the batch-invariance tests), then 9B-class batch 1/8/32, MTP off
#           and k = 3 at 0.8, each row in the default and in deterministic mode (its cost, same run)
#   pp      pipeline stages on one GPU (one H200 is enough): tests/test_cuda.py, then 9B-class PP = 1 and
#           PP = 2 with both stages on cuda:0, batch 1/8, MTP off and k = 3 at 0.8, and the stage link's
#           cost per message; batch 8 again as one micro-batch; each part runs even if one before it failed (the exit status says)
#   moe     one H200: the MoE tests of tests/test_cuda.py (the 35B-A3B-class checkpoint written meanwhile, its
#           routed experts zeros in holes: ~6 GB of disk, not 70), the fused expert kernels against the grouped
#           GEMM (bench/moe_kernels.py --sweep), then 35B-A3B-class TP = 1 batch 1/8, MTP off and k = 3 at 0.8
#   moe-wide  one H200, after moe on the same machine (or it writes the checkpoint first): 35B-A3B-class batch 32,
#           MTP off and k = 3 at 0.8, prefill 2k/8k, then batch 1/8 again with transformers' generate in the same run
#   fp8     one H200, ~9 minutes: the FP8 GPU tests (tests/test_cuda.py + tests/test_kernels.py -k fp8, the FP8
#           floor's test; the 9B-class bf16 checkpoint and its FP8 twin written meanwhile), the FP8 GEMMs at the 9B
#           shapes (bench/fp8_gemm.py: decode GEMV at 1/8/32 rows against its floor and bf16 cuBLAS, prefill W8A8),
#           the teacher-forced agreement (16 prompts × 128 tokens, against the exact FP8 reference and the bf16 twin),
#           then 9B-class bf16 and FP8 in one bench/decode.py run: batch 1/8, MTP off and k = 3 at 0.8, each against
#           its floor; each part runs even if one before failed (the exit status says)
#   parts   one H200, ~4 minutes: where a 9B-class step's device time goes by part against each part's floor
#           (bench/profile_step.py, in-process), batch 1 and 8, MTP off and k = 3 at 0.8, with launch ahead and
#           without (the peer); each part runs even if one before failed
#   gemv    one H200, ~9 minutes: the bf16 decode GEMV against cuBLAS at the 9B shapes (bench/gemv.py, 1-32 rows;
#           the 9B-class checkpoint written meanwhile) and the norm kernel's warps (bench/norm.py), then 9B-class batch 1/8, MTP off and k = 3 at 0.8 with it and
#           with cuBLAS (--no-bf16-gemv, the peer), then the parts of the batch-1 and batch-8 steps with it
#           (bench/profile_step.py); each part runs even if one before failed
#   paged   one H200 or H100, ~9 minutes: the GPU tests of attention, block tables, the prefix cache, MTP and graphs
#           (tests/test_cuda.py + tests/test_kernels.py -k ..., 6 xdist workers; all of them took over 230 s at 4; the 9B-class
#           checkpoint written meanwhile), then 9B-class batch 1/8/32, MTP off and k = 3 at 0.8, with the paged cache,
#           then the same with the contiguous slots from before paging (the peer, same machine): PEER (default .peer)
#           holds `git archive 4b36bee src bench`, whose bench/decode.py runs on its own src; each part runs even if
#           one before failed
#   serving one H200 or H100, ~9 minutes: on the 9B-class weights with the bundled model's tokenizer and chat template
#           (.bench/9b-chat, eos its <|endoftext|>; .bench/9b-qwen, Qwen3.5's chat format, for the prefix cache's
#           trace): bench/prefix_cache.py, a turn whose ~8,000-token conversation is
#           cached against cold (cache on and off), and its sweep at serve's default --cache-memory; then
#           bench/structured.py, MTP on and off; each part runs even if one before failed
#   pp-b1   one H200 or H100, ~8 minutes: 9B-class batch 1, MTP off and k = 3 at 0.8, PP = 1 and PP = 2 with both
#           stages on cuda:0 (8 GiB of cache a stage: the default takes 90 % of the GPU), then PP = 2's link cost;
#           each run within 280 s (PP = 2 loads and captures two stages: over 150 s on an H100)
#   cached-turn  one H200 or H100, ~9 minutes: while the 9B-class checkpoint is written, the GPU tests of the tail
#           graphs, the padded kernels and their saves, the attention kernels and the prefix cache, then a cached 8,000-token turn on the
#           worker alone (bench/profile_step.py --cached-turn, in-process, MTP off and k = 3: from the tail graphs and
#           eagerly, its peer, without a save and with one or two; and decode steps at a 512-token and at that context,
#           attention's keys split and not, its peer), then
#           bench/prefix_cache.py's two conversations of an 8,000-token system prompt in Qwen3.5's chat format
#           (.bench/9b-qwen; cache on and off, where each
#           turn's time to first token goes)
#   grammar one H200 or H100, ~8 minutes: where the 9B-class checkpoint is still to write, the GPU tests of launch
#           ahead, grammars and the prefix cache while it is written; then bench/structured.py on the 9B-class weights
#           with the bundled tokenizer, MTP on and off, batch 1 and 8 (with the grammar's host time a step)
#   grammar-ab  one H200 or H100, ~6 minutes: bench/structured.py on the 9B-class weights (up to 64 tokens a request),
#           MTP off at batch 1 with launch ahead and without (its peer), then MTP on at batch 1 and 8 with it
#   grammar-bundled  one H200 or H100, ~2 minutes: bench/structured.py on the bundled model (no checkpoint to write),
#           MTP off at batch 1 with launch ahead and without (its peer), then MTP on at batch 1 and 8 with it
#   pp-profile  one H200 or H100, ~4 minutes: where a PP = 2 step at batch 1 without MTP goes past PP = 1's (both stages
#           on cuda:0): PP = 2 with every worker under the profiler (SHARDSPEC_PROFILE, steps 20 to 51 of its load),
#           then bench/trace_gaps.py over both workers' traces (the device's idle gaps and what each host was in at
#           them) and each worker's step table
#   serving-tests  one H200 or H100, ~6 minutes: tests/test_cuda.py (6 xdist workers: the prefix cache, JSON under
#           CUDA graphs, PP = 2 at the 9B widths, launch ahead, ...; the 9B-class checkpoint written meanwhile, for a
#           stage after it)
# Then, where matplotlib is: python bench/plot_decode.py OUT/decode-9b-tp1.json ... --out docs/decode.png
set -euo pipefail
if [ $# -lt 3 ]; then
    sed -n '2,/^set -euo/{/^set -euo/!p}' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
wheels=$1 out=$2
shift 2
for stage in "$@"; do
    case $stage in
    tests | 9b | 9b-tp2 | tp2-profile | 27b | floor | deterministic | pp | moe | moe-wide | fp8 | parts | gemv | paged \
        | serving | pp-b1 | pp-profile | cached-turn | grammar | grammar-ab | grammar-bundled | serving-tests) ;;
    *) echo "gpu.sh: unknown stage '$stage' (tests, 9b, 9b-tp2, tp2-profile, 27b, floor, deterministic, pp, moe, moe-wide, fp8, parts, gemv, paged, serving, pp-b1, pp-profile, cached-turn, grammar, grammar-ab, grammar-bundled, serving-tests)" >&2
       exit 2 ;;
    esac
done
mkdir -p "$out" .bench
out=$(cd "$out" && pwd)   # absolute: the peer's run writes it from another folder
failed=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/shardspec-site \
    "$wheels"/*.whl
export PYTHONPATH=/tmp/shardspec-site:$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

gpu_idle() {  # end what a run cut short left on the GPU (its workers), so that no timing after it shares the GPU
    local pids
    pids=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' ') || true
    [ -z "$pids" ] || { echo "gpu.sh: ending leftover GPU processes $pids" >&2; kill $pids 2>/dev/null || true; sleep 3; }
}

write_9b() {  # the 9B-class checkpoint; .bench/9b-chat: its weights with the bundled tokenizer, chat template and eos;
    # .bench/9b-qwen: its weights with Qwen3.5's chat format (testing.chat_model: the bundled vocabulary plus Qwen's
    # added tokens), whose prompts split at <|im_start|> and <|im_end|> as a real Qwen3.5's do (the bundled
    # template has no added tokens: a prompt of it is tokenized whole at every turn); 9b-chat last (what stages test)
    [ -f .bench/9b/config.json ] || python3 -m shardspec.testing.random_checkpoint .bench/9b --size 9b || return 1
    for chat in 9b-qwen 9b-chat; do
        mkdir -p .bench/$chat
        for f in .bench/9b/*; do [ "${f##*/}" = config.json ] || ln -sf "$PWD/$f" .bench/$chat/; done
    done
    cp src/shardspec/bundled/tokenizer.json src/shardspec/bundled/tokenizer_config.json .bench/9b-chat/
    python3 -c 'import json; from shardspec.testing.chat_model import write_chat_files
write_chat_files(".bench/9b-qwen"); c = json.load(open(".bench/9b/config.json")); t = c.get("text_config", c)
t["eos_token_id"] = c["eos_token_id"] = 0
for chat in ("9b-qwen", "9b-chat"): json.dump(c, open(f".bench/{chat}/config.json", "w"))'
}

for stage in "$@"; do
    case $stage in
    tests)
        python3 -m pytest -q tests/test_cuda.py tests/test_kernels.py --durations=10 2>&1 | tee "$out/tests.log"
        {   # MTP on = off again with the other variants: NCCL only (not the symmetric-memory all-reduce), the cuBLAS draft head
            python3 -m pytest -q tests/test_cuda.py -k "mtp and 2" --worker-flags="--allreduce nccl"
            python3 -m pytest -q tests/test_cuda.py -k mtp --worker-flags="--draft-head cublas"
        } 2>&1 | tee "$out/tests-variants.log"
        ;;
    9b)
        python3 bench/decode.py --size 9b --ckpt .bench/9b --tp 1 --batch 1 8 32 --k 1 2 3 4 --forced 0.6 0.8 \
            --prefill 2048 8192 --hf --out "$out/decode-9b-tp1.json" 2>&1 | tee "$out/decode-9b-tp1.log"
        python3 bench/profile_step.py --size 9b --batch 8 --k 0 3 --prefill 2048 8192 --prefill-chunk 512 2048 2>&1 \
            | tee "$out/profile-9b-prefill.log"   # the batch-8 step in-process, and where a prefill's time goes
        python3 bench/lm_head.py --out "$out/lm-head.json"    # the drafts' LM head, cuBLAS against the kernel
        python3 bench/gdn_tiles.py --out "$out/kernels.json"    # the gated delta rule's tile shapes
        python3 bench/decode.py --size 9b --ckpt .bench/9b --tp 1 --batch 1 8 --k 3 --draft-head cublas \
            --forced 0.8 --prefill --out "$out/decode-9b-tp1-cublas-head.json" 2>&1 | grep -v -i warn
        ;;
    9b-tp2)
        python3 bench/decode.py --size 9b --ckpt .bench/9b --tp 1 --batch 1 8 32 --k 3 --forced 0.8 \
            --prefill 2048 8192 --out "$out/decode-9b-tp1-k3.json" 2>&1 | tee "$out/decode-9b-tp1-k3.log"
        python3 bench/decode.py --size 9b --ckpt .bench/9b --tp 2 --allreduce symm --batch 1 8 32 --k 3 \
            --forced 0.8 --prefill 2048 --out "$out/decode-9b-tp2-symm.json" 2>&1 | tee "$out/decode-9b-tp2-symm.log"
        python3 bench/decode.py --size 9b --ckpt .bench/9b --tp 2 --allreduce symm --no-fused-norm \
            --batch 1 8 32 --k 3 --forced 0.8 --prefill --out "$out/decode-9b-tp2-symm-unfused.json" 2>&1 \
            | tee "$out/decode-9b-tp2-symm-unfused.log"
        python3 bench/decode.py --size 9b --ckpt .bench/9b --tp 2 --allreduce nccl --batch 1 8 32 --k 3 \
            --forced 0.8 --prefill --out "$out/decode-9b-tp2.json" 2>&1 | tee "$out/decode-9b-tp2.log"
        ;;
    tp2-profile)
        python3 bench/allreduce.py --out "$out/allreduce.json" 2>&1 | tee "$out/allreduce.log"
        python3 bench/profile_step.py --size 9b --batch 1 --k 0 3 2>&1 | tee "$out/profile-9b.log"
        python3 bench/profile_step.py --size 9b --tp 2 --allreduce symm --batch 1 --k 0 3 2>&1 \
            | tee "$out/profile-9b-tp2.log"   # both ranks' all-reduce kernels: durations, arrival gaps
        python3 bench/profile_step.py --size 9b --tp 2 --allreduce symm --no-fused-norm --batch 1 \
            --k 0 3 2>&1 | tee "$out/profile-9b-tp2-unfused.log"
        ;;
    27b)
        [ -f .bench/27b/config.json ] || python3 -m shardspec.testing.random_checkpoint .bench/27b --size 27b
        python3 bench/decode.py --size 27b --ckpt .bench/27b --tp 2 --allreduce symm --batch 1 8 32 --k 3 \
            --forced 0.8 --prefill --out "$out/decode-27b-tp2-symm.json" 2>&1 | tee "$out/decode-27b-tp2-symm.log"
        python3 bench/decode.py --size 27b --ckpt .bench/27b --tp 1 --batch 1 8 32 --k 3 --forced 0.8 --prefill \
            --out "$out/decode-27b-tp1.json" 2>&1 | tee "$out/decode-27b-tp1.log"
        python3 bench/decode.py --size 27b --ckpt .bench/27b --tp 2 --allreduce symm --no-fused-norm \
            --batch 1 8 32 --k --forced --prefill --out "$out/decode-27b-tp2-symm-unfused.json" 2>&1 \
            | tee "$out/decode-27b-tp2-symm-unfused.log"
        ;;
    floor)
        [ -f .bench/9b/config.json ] || python3 -m shardspec.testing.random_checkpoint .bench/9b --size 9b &
        writer=$!   # on the CPUs, while the tests take the GPU
        timeout 270 python3 -m pytest -q tests/test_cuda.py tests/test_kernels.py --durations=10 --timeout 200 2>&1 \
            | tee "$out/tests.log" || failed=1
        wait $writer || failed=1
        timeout 210 python3 bench/decode.py --size 9b --ckpt .bench/9b --tp 1 --batch 1 8 --k 3 --forced 0.8 --prefill \
            --out "$out/decode-9b-floor.json" 2>&1 | tee "$out/decode-9b-floor.log" || failed=1
        timeout 80 python3 bench/lm_head.py --rows 1 2 16 --out "$out/lm-head.json" 2>&1 | tee "$out/lm-head.log" \
            || failed=1
        ;;
    deterministic)
        [ -f .bench/9b/config.json ] || python3 -m shardspec.testing.random_checkpoint .bench/9b --size 9b &
        writer=$!   # on the CPUs, while the tests take the GPU
        timeout 240 python3 -m pytest -q tests/test_cuda.py --durations=10 --timeout 200 2>&1 \
            | tee "$out/tests-deterministic.log" || failed=1
        wait $writer || failed=1
        timeout 250 python3 bench/decode.py --size 9b --ckpt .bench/9b --tp 1 --batch 1 8 32 --k 3 --forced 0.8 \
            --prefill --deterministic --out "$out/decode-9b-deterministic.json" 2>&1 \
            | tee "$out/decode-9b-deterministic.log" || failed=1
        ;;
    pp)
        [ -f .bench/9b/config.json ] || python3 -m shardspec.testing.random_checkpoint .bench/9b --size 9b &
        writer=$!   # on the CPUs, while the tests take the GPU
        python3 -m pytest -q tests/test_cuda.py --durations=10 --timeout 300 2>&1 | tee "$out/tests-pp.log" || failed=1
        wait $writer || failed=1
        python3 bench/decode.py --size 9b --ckpt .bench/9b --tp 1 --batch 1 8 --k 3 --forced 0.8 --prefill \
            --out "$out/decode-9b-pp1.json" 2>&1 | tee "$out/decode-9b-pp1.log" || failed=1
        python3 bench/decode.py --size 9b --ckpt .bench/9b --pp 2 --device cuda:0 --batch 1 8 --k 3 --forced 0.8 \
            --prefill --link-cost --out "$out/decode-9b-pp2.json" 2>&1 | tee "$out/decode-9b-pp2.log" || failed=1
        python3 bench/decode.py --size 9b --ckpt .bench/9b --pp 2 --micro-batches 1 --device cuda:0 --batch 8 --k 3 \
            --forced 0.8 --prefill --out "$out/decode-9b-pp2-mb1.json" 2>&1 | tee "$out/decode-9b-pp2-mb1.log" || failed=1
        ;;
    moe)
        [ -f .bench/35b-a3b/config.json ] || python3 -m shardspec.testing.random_checkpoint .bench/35b-a3b \
            --size 35b-a3b --zero-experts &
        writer=$!   # on the CPUs, while the tests take the GPU
        timeout 160 python3 -m pytest -q tests/test_cuda.py -k moe --durations=10 --timeout 150 2>&1 \
            | tee "$out/tests-moe.log" || failed=1   # 7 tests: 98 s on one H200
        (cd bench && timeout 150 python3 moe_kernels.py --sweep --tokens 1 4 8 32 --out "$out/moe-kernels.json") 2>&1 \
            | tee "$out/moe-kernels.log" || failed=1   # the fused expert kernels' tiles, against the grouped GEMM
        wait $writer || failed=1
        timeout 240 python3 bench/decode.py --size 35b-a3b --ckpt .bench/35b-a3b --tp 1 --batch 1 8 --k 3 \
            --forced 0.8 --prefill --zero-experts --out "$out/decode-35b-a3b.json" 2>&1 \
            | tee "$out/decode-35b-a3b.log" || failed=1   # ~3 minutes, most of it the load and graph capture
        ;;
    moe-wide)
        [ -f .bench/35b-a3b/config.json ] || python3 -m shardspec.testing.random_checkpoint .bench/35b-a3b \
            --size 35b-a3b --zero-experts || failed=1
        timeout 200 python3 bench/decode.py --size 35b-a3b --ckpt .bench/35b-a3b --tp 1 --batch 32 --k 3 \
            --forced 0.8 --prefill 2048 8192 --zero-experts --out "$out/decode-35b-a3b-b32.json" 2>&1 \
            | tee "$out/decode-35b-a3b-b32.log" || failed=1
        timeout 330 python3 bench/decode.py --size 35b-a3b --ckpt .bench/35b-a3b --tp 1 --batch 1 8 --k --prefill \
            --hf --zero-experts --out "$out/decode-35b-a3b-hf.json" 2>&1 \
            | tee "$out/decode-35b-a3b-hf.log" || failed=1   # transformers' generate beside the engine
        ;;
    fp8)
        {   # on the CPUs, while the tests take the GPU: the bf16 checkpoint and its FP8 twin (same seed) side by side
            [ -f .bench/9b/config.json ] || python3 -m shardspec.testing.random_checkpoint .bench/9b --size 9b &
            bf16=$!
            [ -f .bench/9b-fp8/config.json ] || python3 -m shardspec.testing.random_checkpoint .bench/9b-fp8 --size 9b --fp8
            written=$?
            wait $bf16 && exit $written
        } &
        writer=$!
        timeout 190 python3 -m pytest -q tests/test_cuda.py tests/test_kernels.py tests/test_step_bytes.py -k fp8 \
            --durations=10 --timeout 150 2>&1 | tee "$out/tests-fp8.log" || failed=1
        timeout 70 python3 bench/fp8_gemm.py --out "$out/fp8-gemm.json" 2>&1 | tee "$out/fp8-gemm.log" || failed=1
        wait $writer || failed=1
        timeout 110 python3 bench/fp8_agreement.py --bf16 .bench/9b --fp8 .bench/9b-fp8 --prompts 16 --tokens 128 \
            --out "$out/fp8-agreement-9b.json" 2>&1 | tee "$out/fp8-agreement-9b.log" || failed=1
        timeout 260 python3 bench/decode.py --size 9b --ckpt .bench/9b --fp8 --fp8-ckpt .bench/9b-fp8 --fp8-decode w8a8 weight-only --tp 1 \
            --batch 1 8 --k 3 --forced 0.8 --prefill --out "$out/decode-9b-fp8.json" 2>&1 \
            | tee "$out/decode-9b-fp8.log" || failed=1
        ;;
    parts)
        for batch in 1 8; do
            for ahead in launch-ahead:auto no-launch-ahead:off; do   # the log's name, the option
                timeout 110 python3 bench/profile_step.py --size 9b --batch $batch --k 0 3 --launch-ahead "${ahead#*:}" \
                    2>&1 | tee "$out/profile-9b-parts-b$batch-${ahead%%:*}.log" || failed=1
            done
        done
        ;;
    gemv)
        [ -f .bench/9b/config.json ] || python3 -m shardspec.testing.random_checkpoint .bench/9b --size 9b &
        writer=$!   # on the CPUs, while the GEMVs take the GPU
        (cd bench && timeout 100 python3 gemv.py --out "$out/gemv.json" && timeout 40 python3 norm.py \
            --out "$out/norm.json") 2>&1 | tee "$out/gemv.log" || failed=1
        wait $writer || failed=1
        for gemv in 1 0; do
            cublas=$([ "$gemv" = 0 ] && echo --no-bf16-gemv || true)   # 0: the peer, cuBLAS
            timeout 200 python3 bench/decode.py --size 9b --ckpt .bench/9b --tp 1 --batch 1 8 $cublas \
                --k 3 --forced 0.8 --prefill --out "$out/decode-9b-gemv-$gemv.json" 2>&1 \
                | tee "$out/decode-9b-gemv-$gemv.log" || failed=1
        done
        for batch in 1 8; do
            timeout 100 python3 bench/profile_step.py --size 9b --batch $batch --k 0 3 2>&1 \
                | tee "$out/profile-9b-parts-b$batch-gemv.log" || failed=1
        done
        ;;
    paged)
        write_9b &
        writer=$!   # on the CPUs, while the tests take the GPU
        timeout 230 python3 -m pytest -q -n 6 -rf tests/test_cuda.py tests/test_kernels.py --durations=15 --timeout 200 \
            -k "paged or table or prefix or mtp or graph or attention or powers" 2>&1 | tee "$out/tests-paged.log" || failed=1
        gpu_idle
        wait $writer || failed=1
        timeout 165 python3 bench/decode.py --size 9b --ckpt .bench/9b --tp 1 --batch 1 8 32 --k 3 --forced 0.8 --prefill \
            --out "$out/decode-9b-paged.json" 2>&1 | tee "$out/decode-9b-paged.log" || failed=1
        peer=${PEER:-.peer}   # the contiguous slots: its own bench/decode.py on its own src, the same checkpoint
        (cd "$peer" && PYTHONPATH=/tmp/shardspec-site:$PWD/src timeout 165 python3 bench/decode.py --size 9b \
            --ckpt "$OLDPWD/.bench/9b" --tp 1 --batch 1 8 32 --k 3 --forced 0.8 --prefill \
            --out "$out/decode-9b-contiguous.json") 2>&1 | tee "$out/decode-9b-contiguous.log" || failed=1
        ;;
    serving)
        [ -f .bench/9b-chat/config.json ] || write_9b || failed=1
        timeout 230 python3 bench/prefix_cache.py --system-tokens 8000 --conversations 2 --turns 2 --concurrency 1 \
            --max-tokens 16 --json "$out/prefix-cache-9b-8000.json" -- --model .bench/9b-qwen --local 1 2>&1 \
            | tee "$out/prefix-cache-9b-8000.log" || failed=1
        timeout 130 python3 bench/prefix_cache.py --sweep --cache-memory default --sweep-requests 1 16 64 \
            --sweep-max-tokens 64 --json "$out/prefix-cache-9b-sweep.json" -- --model .bench/9b-chat --local 1 2>&1 \
            | tee "$out/prefix-cache-9b-sweep.log" || failed=1
        for mtp in on off; do   # the target (MTP on) first
            timeout 100 python3 bench/structured.py --model .bench/9b-chat --local 1 --mtp $mtp \
                --json "$out/structured-9b-mtp-$mtp.json" 2>&1 | tee "$out/structured-9b-mtp-$mtp.log" || failed=1
        done
        ;;
    cached-turn)
        [ -f .bench/9b-chat/config.json ] || { write_9b > "$out/write-9b.log" 2>&1 & }
        # (greedy and speculative decoding's GPU tests: serving-tests; these fit beside the checkpoint's writing)
        timeout 240 python3 -m pytest -q -n 4 -rf tests/test_cuda.py tests/test_kernels.py --timeout 150 \
            -k "tail_graphs or prefix_cache_hits or padded or saves or attention" 2>&1 \
            | tee "$out/tests-tails.log" || failed=1
        timeout 260 python3 bench/profile_step.py --size 9b --k 0 3 --steps 10 --cached-turn 8000 60 2>&1 \
            | tee "$out/cached-turn-9b.log" || failed=1
        wait
        [ -f .bench/9b-chat/config.json ] || failed=1
        timeout 230 python3 bench/prefix_cache.py --system-tokens 8000 --conversations 2 --turns 2 --concurrency 1 \
            --max-tokens 16 --json "$out/prefix-cache-9b-8000.json" -- --model .bench/9b-qwen --local 1 \
            2>&1 | tee "$out/prefix-cache-9b-8000.log" || failed=1
        ;;
    grammar)
        if [ ! -f .bench/9b-chat/config.json ]; then   # the GPU tests of launch ahead and grammars meanwhile
            write_9b > "$out/write-9b.log" 2>&1 &
            timeout 200 python3 -m pytest -q -n 4 -rf tests/test_cuda.py --timeout 180 \
                -k "launch or json or sampled_and_constrained or prefix" 2>&1 | tee "$out/tests-grammar.log" || failed=1
            wait $! || failed=1
        fi
        for mtp in on off; do   # the target (MTP on) first
            timeout 140 python3 bench/structured.py --model .bench/9b-chat --local 1 --mtp $mtp --batch 1 8 \
                --json "$out/structured-9b-mtp-$mtp.json" 2>&1 | tee "$out/structured-9b-mtp-$mtp.log" || failed=1
        done
        ;;
    grammar-ab)
        [ -f .bench/9b-chat/config.json ] || write_9b > "$out/write-9b.log" 2>&1 || failed=1
        for run in "off 1 auto" "off 1 off" "on 1 8 auto"; do   # MTP, batches, launch ahead (and its peer)
            set -- $run
            mtp=$1 ahead=${!#} batches=${*:2:$#-2}
            timeout 100 python3 bench/structured.py --model .bench/9b-chat --local 1 --mtp $mtp --batch $batches \
                --max-tokens 64 --launch-ahead $ahead --json "$out/structured-9b-mtp-$mtp-ahead-$ahead.json" 2>&1 \
                | tee "$out/structured-9b-mtp-$mtp-ahead-$ahead.log" || failed=1
        done
        ;;
    grammar-bundled)
        for run in "off 1 auto" "off 1 off" "on 1 8 auto"; do   # MTP, batches, launch ahead (and its peer)
            set -- $run
            mtp=$1 ahead=${!#} batches=${*:2:$#-2}
            timeout 60 python3 bench/structured.py --local 1 --mtp $mtp --batch $batches --launch-ahead $ahead \
                --json "$out/structured-bundled-mtp-$mtp-ahead-$ahead.json" 2>&1 \
                | tee "$out/structured-bundled-mtp-$mtp-ahead-$ahead.log" || failed=1
        done
        ;;
    serving-tests)
        [ -f .bench/9b-chat/config.json ] || { write_9b > "$out/write-9b.log" 2>&1 & }   # for a stage after it
        timeout 330 python3 -m pytest -q -n 6 -rf tests/test_cuda.py --durations=10 --timeout 300 2>&1 \
            | tee "$out/tests-serving.log" || failed=1
        wait
        ;;
    pp-b1)
        [ -f .bench/9b/config.json ] || write_9b || failed=1
        for pp in 1 2; do
            timeout 280 python3 bench/decode.py --size 9b --ckpt .bench/9b --pp $pp --device cuda:0 --cache-memory 8GiB \
                --batch 1 --k 3 --forced 0.8 --prefill $([ $pp = 2 ] && echo --link-cost) \
                --out "$out/decode-9b-pp$pp-paged.json" 2>&1 | tee "$out/decode-9b-pp$pp-paged.log" || failed=1
        done
        ;;
    pp-profile)
        [ -f .bench/9b/config.json ] || write_9b || failed=1
        rm -rf /tmp/pp-profile && mkdir -p /tmp/pp-profile
        SHARDSPEC_PROFILE=/tmp/pp-profile:20:52 timeout 280 python3 bench/decode.py --size 9b --ckpt .bench/9b --pp 2 \
            --device cuda:0 --cache-memory 8GiB --batch 1 --k --new-tokens 64 --out "$out/decode-9b-pp2-profiled.json" \
            2>&1 | tee "$out/decode-9b-pp2-profiled.log" || failed=1
        python3 bench/trace_gaps.py /tmp/pp-profile/worker-*-1.json.gz 2>&1 | tee "$out/trace-gaps-9b-pp2.log" || failed=1
        cat /tmp/pp-profile/worker-*.txt > "$out/profile-9b-pp2-workers.txt" || failed=1
        ;;
    esac
done
exit $failed
