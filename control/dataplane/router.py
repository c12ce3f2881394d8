"""The transport's TENSOR handler, one per daemon: `TensorRouter` hands tensors and connection
events to the `TransportComm` of this peer's current epoch (control/dataplane/comm.py) and
refuses tensors while none is attached. No torch: an idle daemon registers it at start, so a
tensor sent to a peer without a stage is refused with the reason.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtfm.net import PeerConnection, PeerTransport

from ..messages import ControlMsg
from .wire import TensorMsg, refuse

if TYPE_CHECKING:
    from .comm import TransportComm

__all__ = ["TensorRouter"]


class TensorRouter:
    """Owns the transport's TENSOR handler (registered once per daemon) and routes tensors and
    connection events to the attached `TransportComm`; refuses tensors while none is."""

    def __init__(self, transport: PeerTransport):
        self.transport = transport
        self._comm: TransportComm | None = None
        transport.handle(ControlMsg.TENSOR, self._handle)
        transport.on_connect(self._on_connect)
        transport.on_disconnect(self._on_disconnect)

    def attach(self, comm: TransportComm) -> None:
        if self._comm is not None:
            raise RuntimeError("another TransportComm is running on this transport: close it first")
        self._comm = comm

    def detach(self, comm: TransportComm) -> None:
        if self._comm is comm:
            self._comm = None

    async def _handle(self, conn: PeerConnection, msg_type: int, body: object, payload: memoryview | None) -> object:
        msg = TensorMsg.from_wire(body)
        if self._comm is None:
            return refuse(conn.short_id, msg.tag, "no training run in progress")
        return await self._comm._receive(conn.peer_id, msg, payload)

    def _on_connect(self, conn: PeerConnection) -> None:
        if self._comm is not None:
            self._comm._on_connect(conn.peer_id)

    def _on_disconnect(self, conn: PeerConnection, reason: str) -> None:
        if self._comm is not None and self.transport.connection(conn.peer_id) is None:
            self._comm._on_lost(conn.peer_id, reason)
