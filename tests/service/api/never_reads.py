"""A Generate client that submits and never reads: ``never_reads.py TARGET N
TOKENS``. Prints ``sent`` once its N submits are written; the test then stops
the process. A small per-stream window (lookahead) and no BDP probing keep
what the client's side absorbs small, so the server's own buffer fills soon."""

from __future__ import annotations

import sys
import time

import grpc

from slipstream.v1 import inference_pb2 as pb
from slipstream.v1 import inference_pb2_grpc as pb_grpc


def main() -> None:
    target, num_requests, num_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 16384)]
    channel = grpc.insecure_channel(target, options=options)
    stub = pb_grpc.InferenceStub(channel)
    sent = __import__("threading").Event()

    def requests():  # type: ignore[no-untyped-def]
        for i in range(num_requests):
            yield pb.GenerateRequest(
                submit=pb.Submit(
                    request_id=f"r{i}",
                    token_ids=pb.TokenIds(ids=[5, 6, 7 + i]),
                    stopping=pb.StoppingCriteria(max_new_tokens=num_tokens, ignore_eos=True),
                )
            )
        sent.set()
        time.sleep(3600)

    call = stub.Generate(requests())
    sent.wait()
    print("sent", flush=True)
    time.sleep(3600)
    call.cancel()


if __name__ == "__main__":
    main()
