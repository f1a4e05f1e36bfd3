"""What gRPC Python itself moves, with no Flotilla code: the ceiling under ``ps_bench``'s transport figures.

One process serves a 64 MiB payload as a server stream of 1 MiB chunks (as ``GetVariableStream`` does)
on 127.0.0.1 and fetches it into a reused buffer over 1, 2 and 4 parallel streams on separate channels,
each fetching its share; the median of ``--reps`` fetches, in GB/s (1e9 bytes/s).

Then the cost of a small call (a Barrier's size): the process CPU (both ends, one process) per unary call
and per message on an open bidirectional stream, ``--calls`` of each after a warm-up.

``python bench/grpc_ceiling.py [--mib 64] [--chunk-mib 1] [--reps 7] [--calls 3000]``
"""
from __future__ import annotations

import argparse
import queue
import time
from concurrent import futures
from typing import Callable, Iterator

import grpc

OPTIONS = [("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--chunk-mib", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--calls", type=int, default=3000, help="small calls timed each way (0: skip)")
    args = ap.parse_args()
    size, chunk = args.mib << 20, args.chunk_mib << 20
    payload = memoryview(bytes(size))

    def serve(request: bytes, context: object) -> object:
        lo, hi = (int(x) for x in request.decode().split(","))
        for at in range(lo, hi, chunk):
            yield bytes(payload[at:min(at + chunk, hi)])

    def echo(request: bytes, context: object) -> bytes:
        return b"ok"

    def echo_stream(requests: Iterator[bytes], context: object) -> Iterator[bytes]:
        for _ in requests:
            yield b"ok"

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "ceiling.Bulk", {"Get": grpc.unary_stream_rpc_method_handler(serve),
                         "Echo": grpc.unary_unary_rpc_method_handler(echo),
                         "EchoStream": grpc.stream_stream_rpc_method_handler(echo_stream)}),))
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
        if args.calls:
            small_calls(channels[0], args.calls)
    finally:
        for channel in channels:
            channel.close()
        server.stop(None)
        pool.shutdown()


def small_calls(channel: grpc.Channel, calls: int) -> None:
    """CPU (this process: client and server) per small unary call and per message on an open stream."""
    unary = channel.unary_unary("/ceiling.Bulk/Echo")
    outbox: queue.Queue[bytes | None] = queue.Queue()

    def requests() -> Iterator[bytes]:
        while (item := outbox.get()) is not None:
            yield item

    replies = channel.stream_stream("/ceiling.Bulk/EchoStream")(requests())

    def on_stream(request: bytes) -> None:
        outbox.put(request)
        next(replies)

    ways: dict[str, Callable[[bytes], object]] = {"unary call": lambda r: unary(r, timeout=10),
                                                  "message on a bidirectional stream": on_stream}
    try:
        for what, call in ways.items():
            for _ in range(200):
                call(b"x")
            cpu, wall = time.process_time(), time.perf_counter()
            for _ in range(calls):
                call(b"x")
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            print(f"small {what}: {cpu / calls * 1e3:.3f} ms CPU (both ends), {wall / calls * 1e3:.3f} ms wall",
                  flush=True)
    finally:
        outbox.put(None)


if __name__ == "__main__":
    main()
