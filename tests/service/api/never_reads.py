"""A Generate client that submits and never reads: ``never_reads.py TARGET N
TOKENS [STREAMS]``. Prints ``sent`` once its N submits (on each of STREAMS
streams, default 1) are written; the test then stops the process. A small
per-stream window (lookahead) and no BDP probing keep what the client's side
absorbs small, so the server's own buffer fills soon."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator

import grpc

from slipstream.v1 import inference_pb2 as pb
from slipstream.v1 import inference_pb2_grpc as pb_grpc


def main() -> None:
    target, num_requests, num_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    num_streams = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 16384)]
    channel = grpc.insecure_channel(target, options=options)
    stub = pb_grpc.InferenceStub(channel)
    barrier = threading.Barrier(num_streams + 1)

    def requests(stream: int) -> Iterator[pb.GenerateRequest]:
        for i in range(num_requests):
            yield pb.GenerateRequest(
                submit=pb.Submit(
                    request_id=f"r{i}",
                    token_ids=pb.TokenIds(ids=[5, 6, 7 + i, 8 + stream % 4000]),
                    stopping=pb.StoppingCriteria(max_new_tokens=num_tokens, ignore_eos=True),
                )
            )
        barrier.wait()
        time.sleep(3600)

    calls = [stub.Generate(requests(s)) for s in range(num_streams)]
    barrier.wait()
    print("sent", flush=True)
    time.sleep(3600)
    for call in calls:
        call.cancel()


if __name__ == "__main__":
    main()
