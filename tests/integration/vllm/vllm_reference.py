"""One plain vLLM process: `vllm.LLM` over the whole model, greedy, ignore_eos.

    python vllm_reference.py IN.json OUT.json    # IN: {"model", "prompts", "max_tokens", "dtype"?}

Writes the generated token ids of each prompt. fp32 (unless IN names another dtype: vLLM's fp8
checkpoints need bfloat16) and eager, like the vllm engine's stages on CPU (so the comparison is
about the stage split, not about dtype or compilation).
"""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(sys.argv[1]) as f:
        spec = json.load(f)
    llm = LLM(model=spec["model"], dtype=spec.get("dtype", "float32"), enforce_eager=True, seed=0,
              skip_tokenizer_init=True, enable_prefix_caching=False, max_model_len=2048,
              kv_cache_memory_bytes=256 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True,
                            detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], params)
    with open(sys.argv[2], "w") as f:
        json.dump([list(o.outputs[0].token_ids) for o in outs], f)


if __name__ == "__main__":
    main()
