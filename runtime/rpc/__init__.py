"""The parameter-server runtime over gRPC: the wire format (``wire``), the pure pserver state
(``pserver``), the gRPC servicer and server (``server``), the trainer's client (``client``), chunked
streams (``stream``), and the data plane beside gRPC: shared memory on one host (``shm``), a TCP stream
across hosts (``tcp_plane``).

``send_recv.proto`` is the protocol; ``send_recv_pb2*.py`` are generated from it by
``scripts/gen_proto.py`` and checked in.
"""
from __future__ import annotations
