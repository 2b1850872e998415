"""``rpcdist.transport``: everything that moves bytes between two workers, and nothing else.

Layers, bottom up::

    frames     the wire codec: Frame/Envelope encoding, chunking, reassembly
    shm        shared-memory handoff and reusable slots between workers of one host
    writer     batched, interleaved writes of queued messages onto one link
    api        the interface: Link, LinkHandler, Session, PeerAddress
    grpc_link  a Link over a gRPC bidirectional stream (any two hosts)
    unix_link  a Link over a Unix-domain socket (workers of one host)
    reply_channel  sockets on which a co-located callee answers a waiting thread directly
    endpoint   Transport: serving, one link per peer, co-location, teardown

The transport knows nothing of functions, RRefs or collectives: the agent
(:mod:`rpcdist.agent`) gives meaning to the frames.
"""

from rpcdist.transport.api import Entries, Link, LinkHandler, PeerAddress, Session, SessionFactory
from rpcdist.transport.endpoint import Transport
from rpcdist.transport.frames import FrameError

__all__ = [
    "Entries",
    "FrameError",
    "Link",
    "LinkHandler",
    "PeerAddress",
    "Session",
    "SessionFactory",
    "Transport",
]
