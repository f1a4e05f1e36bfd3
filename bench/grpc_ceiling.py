"""What gRPC Python itself moves, with no Flotilla code: the ceiling under ``ps_bench``'s transport figures.

One process serves a 64 MiB payload as a server stream of 1 MiB chunks (as ``GetVariableStream`` does)
on 127.0.0.1 and fetches it into a reused buffer over 1, 2 and 4 parallel streams on separate channels,
each fetching its share; the median of ``--reps`` fetches, in GB/s (1e9 bytes/s).

``python bench/grpc_ceiling.py [--mib 64] [--chunk-mib 1] [--reps 7]``
"""
from __future__ import annotations

import argparse
import time
from concurrent import futures

import grpc

OPTIONS = [("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--chunk-mib", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    size, chunk = args.mib << 20, args.chunk_mib << 20
    payload = memoryview(bytes(size))

    def serve(request: bytes, context: object) -> object:
        lo, hi = (int(x) for x in request.decode().split(","))
        for at in range(lo, hi, chunk):
            yield bytes(payload[at:min(at + chunk, hi)])

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "ceiling.Bulk", {"Get": grpc.unary_stream_rpc_method_handler(serve)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channels = [grpc.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS + [("flotilla.channel", i)])
                for i in range(4)]
    into = bytearray(size)
    pool = futures.ThreadPoolExecutor(max_workers=4)

    def fetch(channel: grpc.Channel, lo: int, hi: int) -> None:
        at = lo
        for piece in channel.unary_stream("/ceiling.Bulk/Get")(f"{lo},{hi}".encode()):
            into[at:at + len(piece)] = piece
            at += len(piece)

    try:
        for streams in (1, 2, 4) * 2:  # twice round: the first pass also warms the process up
            share = size // streams
            times = []
            for _ in range(args.reps):
                start = time.perf_counter()
                jobs = [pool.submit(fetch, channels[i], i * share, (i + 1) * share) for i in range(streams)]
                for job in jobs:
                    job.result()
                times.append(time.perf_counter() - start)
            print(f"{args.mib} MiB as {args.chunk_mib} MiB chunks over {streams} stream(s): "
                  f"{size / sorted(times)[len(times) // 2] / 1e9:.2f} GB/s", flush=True)
    finally:
        for channel in channels:
            channel.close()
        server.stop(None)
        pool.shutdown()


if __name__ == "__main__":
    main()
