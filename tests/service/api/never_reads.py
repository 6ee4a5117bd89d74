"""A Generate client that submits and never reads: ``never_reads.py TARGET N
TOKENS``. Prints ``sent`` once its N submits are written; the test then stops
the process. BDP probing is off so the channel keeps HTTP/2's default window
(64 KiB) instead of growing it while the first tokens arrive."""

from __future__ import annotations

import sys
import time

import grpc

from slipstream.v1 import inference_pb2 as pb
from slipstream.v1 import inference_pb2_grpc as pb_grpc


def main() -> None:
    target, num_requests, num_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    channel = grpc.insecure_channel(target, options=[("grpc.http2.bdp_probe", 0)])
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
