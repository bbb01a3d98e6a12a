"""An engine process with the real Engine and EngineServer but a scripted runner (no torch): it "generates" the
token ids of a fixed text with multi-byte characters, so sidecar tests can check detokenization, stop strings,
disconnects and restarts exactly and fast.

    python tests/support/fake_engine_server.py --socket PATH --model-dir DIR
"""

from __future__ import annotations

import argparse
import logging
import signal
import time

from overlap.engine.config import EngineConfig
from overlap.engine.core import Engine
from overlap.engine.serving.server import EngineServer
from overlap.engine.types import Runner, RunnerOutput

SCRIPT_TEXT = "héllo wörld, 日本語 and 🎉 STOP here. "


class ScriptRunner(Runner):
    """Sequence i's n-th generated token is script[n % len(script)]; each step sleeps `step_s`."""

    block_size = 16
    max_model_len = 2048

    def __init__(self, script: list[int], vocab_size: int, eos_token_id: int, step_s: float, num_kv_blocks: int):
        self.script, self.vocab_size, self.eos_token_ids, self.step_s = script, vocab_size, (eos_token_id,), step_s
        self.num_kv_blocks = num_kv_blocks

    def execute(self, model_input) -> RunnerOutput:
        start = time.perf_counter()
        time.sleep(self.step_s)
        tokens = [self.script[s.num_generated % len(self.script)] for s in model_input.seqs if s.do_sample]
        return RunnerOutput(tokens, (start, time.perf_counter()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--step-s", type=float, default=0.005)
    parser.add_argument("--grace-period-s", type=float, default=5.0)
    parser.add_argument("--num-kv-blocks", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, help="default: the engine's")
    args = parser.parse_args()
    logging.basicConfig(level="INFO")

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(f"{args.model_dir}/tokenizer.json")
    script = tokenizer.encode(SCRIPT_TEXT, add_special_tokens=False).ids
    runner = ScriptRunner(script, tokenizer.get_vocab_size(), tokenizer.token_to_id("</s>"), args.step_s,
                          args.num_kv_blocks)  # fmt: skip
    limits = {"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}
    config = EngineConfig(model=args.model_dir, **limits)
    engine = Engine(config, runner=runner, model_dir=args.model_dir)
    server = EngineServer(engine, args.socket, grace_period_s=args.grace_period_s)
    signal.signal(signal.SIGTERM, lambda *_: server.request_stop())
    signal.signal(signal.SIGINT, lambda *_: server.request_stop())
    server.serve_forever()


if __name__ == "__main__":
    main()
