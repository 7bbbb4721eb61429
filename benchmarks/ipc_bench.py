"""The cost of the process boundary per step: a step's input and output through the pipe.

A child interpreter echoes what it receives the way the worker process answers a step: it
unpickles a :class:`~stoic.model.StepBatch` and sends back a pickled
:class:`~stoic.model.StepOutput`, over the same kind of socket pair and
``multiprocessing.connection.Connection`` as the process executor. The table gives the round
trip per step for decode batches of 1, 8, 32 and 64 sequences (and the bytes each way), to set
against a step's forward pass (tens of milliseconds on a CPU).

    python benchmarks/ipc_bench.py [--steps 2000]
"""

from __future__ import annotations

import argparse
import pickle
import socket
import statistics
import subprocess
import sys
import time
from multiprocessing.connection import Connection

from stoic.model import SampledToken, SamplingParams, SeqChunk, StepBatch, StepOutput

_CHILD = """
import pickle, sys
from multiprocessing.connection import Connection
from stoic.model import SampledToken, StepOutput
conn = Connection(int(sys.argv[1]))
while True:
    try:
        batch = pickle.loads(conn.recv_bytes())
    except EOFError:
        break
    out = StepOutput({c.seq_id: SampledToken(c.token_ids[-1] + 1) for c in batch.chunks if c.sample})
    conn.send_bytes(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL))
"""


def decode_batch(n: int, context: int = 300, block_size: int = 16) -> StepBatch:
    params = SamplingParams(max_tokens=64, temperature=0.0)
    blocks = (context + block_size - 1) // block_size
    return StepBatch(
        tuple(
            SeqChunk(
                seq_id=i,
                token_ids=(1000 + i,),
                start_pos=context,
                block_table=tuple(range(i * blocks, (i + 1) * blocks)),
                sample=True,
                params=params,
                num_generated=10,
            )
            for i in range(n)
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    ours, theirs = socket.socketpair()
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(theirs.fileno())], pass_fds=(theirs.fileno(),)
    )
    theirs.close()
    conn = Connection(ours.detach())
    print("| sequences | bytes in | bytes out | round trip p50 (us) | p99 (us) |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for n in (1, 8, 32, 64):
        batch = decode_batch(n)
        payload_in = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
        times = []
        size_out = 0
        for _ in range(args.steps):
            started = time.perf_counter()
            conn.send_bytes(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL))
            raw = conn.recv_bytes()
            output = pickle.loads(raw)
            times.append(time.perf_counter() - started)
            size_out = len(raw)
        assert isinstance(output, StepOutput) and len(output.sampled) == n
        assert isinstance(next(iter(output.sampled.values())), SampledToken)
        times.sort()
        p50 = statistics.median(times) * 1e6
        p99 = times[int(len(times) * 0.99)] * 1e6
        print(f"| {n} | {len(payload_in)} | {size_out} | {p50:.0f} | {p99:.0f} |")
    conn.close()
    child.wait(10)


if __name__ == "__main__":
    main()
