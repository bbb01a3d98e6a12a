"""The engine container's own startup and liveness probe: `python -m overlap.engine.serving.probe --socket PATH`.

It connects to the engine's socket, reads the Hello the engine sends every connection, and asks for stats: an answer
means the engine has loaded its model (it listens only after) and its loop still turns (the loop, not a thread of its
own, answers). Exit 0 then, 1 with the reason on stderr otherwise. kubelet runs it as an exec probe, so that a model
load that hangs, or an engine that stops stepping, restarts the engine container, which holds the GPU, and not the
sidecar. Imports only the wire protocol: a probe every few seconds must not load torch.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time

from overlap.engine.serving import protocol as p


def probe(socket_path: str, timeout_s: float = 5.0) -> str | None:
    """None when the engine at `socket_path` answers a stats request within `timeout_s`; else why not."""
    deadline = time.monotonic() + timeout_s
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        try:
            sock.connect(socket_path)
        except FileNotFoundError:
            return f"no engine socket at {socket_path} yet (the engine is still loading its model, or not running)"
        except OSError as exc:
            return f"cannot connect to {socket_path}: {exc}"
        sock.sendall(p.encode(p.StatsRequest(seq=1)))
        while True:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            message = p.read_message(sock)
            if message is None:
                return "the engine closed the connection before answering"
            if isinstance(message, p.StatsReply) and message.seq == 1:
                return None
    except TimeoutError:
        return f"the engine did not answer within {timeout_s:g} s (its loop is stuck)"
    except (OSError, p.ProtocolError) as exc:
        return f"the engine's answer broke off: {exc}"
    finally:
        sock.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m overlap.engine.serving.probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--socket", required=True, help="the engine's Unix socket")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer (default 5)")
    args = parser.parse_args(argv)
    why = probe(args.socket, args.timeout)
    if why is not None:
        print(f"engine probe failed: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
