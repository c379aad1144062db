"""The memory tier's buddy copies (`snapshot.memory_peer`): each rank sends every copy it makes to a rank on
another node, whose node keeps it in memory as a `peer` slot, so that the state of a node that is lost
with its memory is still in memory elsewhere (trainapp/snapshots/memory.py resumes from it).

A background thread sends (the step never waits on the network): the newest copy only, read back from
its slot file and checked first (a slot the writer is already overwriting is skipped, the next copy
goes). A listener thread receives: a copy whose checksum holds is written into the older of the owner's
two peer slots, committed last as the rank's own copies are. The connection is plain TCP between the
addresses the ranks reach each other at (the training interface's: network.interface), one per pair,
opened again after any error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from trainapp.snapshots import memory_slots as slots

if TYPE_CHECKING:
    from trainapp.group import DistContext

log = logging.getLogger(__name__)

FRAME = struct.Struct("<QQ")  # owner rank, bytes


def own_address() -> str:
    """Where this host's ranks are reached when no training interface was resolved (network.interface):
    the address of the route to MASTER_ADDR (no packet is sent)."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))
        return str(s.getsockname()[0])
    return "127.0.0.1"


def buddies(nodes: list[str]) -> list[int | None]:
    """Each rank's buddy (None: none, on one node): the rank of the same place among its node's ranks on the
    next node in rank order (or that node's ranks in turn when it has fewer)."""
    order = list(dict.fromkeys(nodes))
    if len(order) < 2:
        return [None] * len(nodes)
    ranks = {n: [r for r, m in enumerate(nodes) if m == n] for n in order}
    out: list[int | None] = []
    for r, n in enumerate(nodes):
        nxt = ranks[order[(order.index(n) + 1) % len(order)]]
        out.append(nxt[ranks[n].index(r) % len(nxt)])
    return out


class PeerLink:
    """This rank's two threads: the listener that keeps other ranks' copies in `root` (its node's memory),
    and the sender of its own copies to its buddy."""

    def __init__(self, root: Path, rank: int, address: str) -> None:
        self.root, self.rank = root, rank
        self.server = socket.create_server((address, 0))
        self.server.settimeout(0.5)
        self.address = (address, self.server.getsockname()[1])
        self.buddy: tuple[int, tuple[str, int]] | None = None
        self._pending: slots.Slot | None = None
        self._wake = threading.Condition()
        self._closed = False
        self._conn: socket.socket | None = None
        self.sent = self.received = 0
        self._threads = [threading.Thread(target=self._listen, name="memory-peer-in", daemon=True),
                         threading.Thread(target=self._send_loop, name="memory-peer-out", daemon=True)]
        for t in self._threads:
            t.start()

    @classmethod
    def start(cls, ctx: DistContext, root: Path, nodes: list[str]) -> PeerLink | None:
        """Every rank (collective): the link, each rank's buddy set from every rank's node and address;
        None on one node."""
        if len(set(nodes)) < 2:
            return None
        chosen = ctx.network.address if ctx.network is not None else None  # the training interface's
        link = cls(root, ctx.rank, chosen or own_address())
        addresses = ctx.files.all_gather_objects(link.address)
        buddy = buddies(nodes)[ctx.rank]
        if buddy is not None:
            link.buddy = (buddy, addresses[buddy])
        return link

    def send(self, slot: slots.Slot) -> None:
        """Send this committed copy to the buddy, in the background (replacing one not yet sent)."""
        with self._wake:
            self._pending = slot
            self._wake.notify()

    def _send_loop(self) -> None:
        while True:
            with self._wake:
                while self._pending is None and not self._closed:
                    self._wake.wait()
                if self._closed or self._pending is None:
                    return
                slot, self._pending = self._pending, None
            data = slots.read_bytes(slot)  # None: the writer is overwriting it, the next copy goes
            if data is None or self.buddy is None:
                continue
            try:
                self._deliver(data)
                self.sent += 1
            except OSError as e:
                log.debug("memory peer: could not send the copy of step %d to rank %d: %s", slot.step,
                          self.buddy[0], e)
                self._drop_connection()

    def _deliver(self, data: bytes) -> None:
        assert self.buddy is not None
        if self._conn is None:
            self._conn = socket.create_connection(self.buddy[1], timeout=30)
        self._conn.sendall(FRAME.pack(self.rank, len(data)))
        self._conn.sendall(data)

    def _drop_connection(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.close()
            self._conn = None

    def _listen(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.server.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(target=self._receive, args=(conn,), name="memory-peer-conn", daemon=True).start()

    def _receive(self, conn: socket.socket) -> None:
        with conn:
            while not self._closed:
                head = _read_exactly(conn, FRAME.size)
                if head is None:
                    return
                owner, size = FRAME.unpack(head)
                data = _read_exactly(conn, size)
                if data is None:
                    return
                if not slots.check(data):
                    continue
                try:
                    slots.write_raw(self._peer_slot(owner), data)
                except OSError as e:  # the run's folder removed at its end, a full tmpfs: not kept
                    log.debug("memory peer: the copy from rank %d was not kept: %s", owner, e)
                    continue
                self.received += 1

    def _peer_slot(self, owner: int) -> Path:
        paths = [self.root / f"peer-{owner:05d}.{k}" for k in (0, 1)]
        seqs = [head.seq if head is not None else -1 for head in map(slots.header, paths)]
        return paths[seqs.index(min(seqs))]

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        with contextlib.suppress(OSError):
            self.server.close()
        self._drop_connection()


def _read_exactly(conn: socket.socket, n: int) -> bytes | None:
    parts, got = [], 0
    while got < n:
        try:
            chunk = conn.recv(min(n - got, 1 << 20))
        except OSError:
            return None
        if not chunk:
            return None
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)
