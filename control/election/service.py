"""`ElectionService`: the trio driver of the coordinator election inside a daemon.

`ElectionState` (control/election/state.py) decides; this module does its I/O. Every input (a
message from the network, the election timer, `set_voters`, `campaign`) is one synchronous
call into the state machine, and the actions it returns are appended to one FIFO, `_actions`.
One task, the loop, executes that FIFO in order and fires the timer:

    loop:  execute the next action            Persist: the store writes (term, vote), in a thread
              (while there is one)            ElectionSend: into the destination's outbox
                                              BecameCoordinator / CoordinatorKnown / SteppedDown:
                                                log, wake the waiters, call the on_event callbacks
           else wait until next_deadline(),
              or until an input wakes it,
              and tick() when it is due

So a Persist completes before any action after it runs, whichever input produced that action:
inputs that arrive while the store writes only queue their actions behind it, and no vote
(nor anything decided after it) leaves before the term and vote that go with it are on disk.
A Persist that fails stops the service: `run()` raises the store's error, and nothing queued
after it is sent. An input is refused, not fatal, when the state machine raises on it or asks
for a Persist the store would refuse (`persist_problem`): its actions are dropped, the error
logged, and the machine reverts to the (term, vote) queued before it (`ElectionState.revert`).

Incoming messages. The ELECTION handler decodes the body (`decode_election`); a malformed body,
or one with a payload, raises ProtocolError and the transport closes that connection. Past
MAX_PENDING_ACTIONS actions not yet executed (a store that writes slowly), incoming messages are
dropped rather than queued.

Sends never block the loop. Each destination has a bounded outbox (OUTBOX_MESSAGES; a message
that does not fit is dropped: Raft tolerates loss) and one task draining it: it reuses the live
connection to the peer, or dials `address_of(peer)` within DIAL_TIMEOUT_S. After a failed dial
it drops messages until a back-off has passed (election_timeout_min_s, doubling up to
REDIAL_BACKOFF_MAX election_timeout_max_s), so a dead peer is not redialled every heartbeat;
a connection the peer opens itself is used at once. A send that fails or takes longer than
SEND_TIMEOUT_S is dropped, logged at DEBUG. A sender idle for SENDER_IDLE_S ends; the next
message to that peer starts another.

Finding the coordinator. A peer outside the coordinator's configuration hears no heartbeat.
`find_coordinator(peers)` asks peers (ControlMsg.COORDINATOR, at most MAX_ASKED of them, each
within its timeout) and feeds every certificate of their answers to the state machine's
`learn`, newest term first (discovery.py); the answer handler serves this peer's own view.
Given `peers` (the live members), the service asks FINDER_ASKS of them every FIND_EVERY
election timeouts while it neither is nor recently heard a coordinator, so a joiner's or a
restarted peer's status names the coordinator without an operator's request.

Queries (`role`, `term`, `coordinator`, `may_apply`, ...) read the state machine, which may be
a moment ahead of the disk while a Persist runs. `is_coordinator`, the waits and the events
follow the executed actions instead: a BecameCoordinator is reported only after the term and
vote that elected it are durable.

Time is trio's (`trio.current_time()`), so the service runs under MockClock; a memory store
(`MemoryElectionStore`) is written inline, any other store in a worker thread (FileElectionStore
fsyncs). Build the service inside trio: the election timer starts at construction.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import random
import time
from collections.abc import Callable, Iterable
from typing import Any

import trio

from dtfm.net import ConnectionClosed, HandshakeError, ProtocolError, RemoteError, RequestTimeout, short_id

from ..allocation import Refusal
from ..messages import ControlMsg
from .config import ElectionConfig
from .certificate import Certificate
from .council import Council
from .discovery import CoordinatorAnswer, Discovery, explain
from .messages import ElectionMessage, check_voters, decode_election
from .state import (
    BecameCoordinator,
    CoordinatorKnown,
    ElectionAction,
    ElectionRole,
    ElectionSend,
    ElectionState,
    Persist,
    PreviousConfiguration,
    SteppedDown,
    VoteSigner,
)
from .store import ElectionStoreError, MemoryElectionStore, persist_problem

__all__ = ["ElectionEvent", "ElectionService"]

logger = logging.getLogger(__name__)

OUTBOX_MESSAGES = 16  # per destination; more waiting than this: the newest is dropped
DIAL_TIMEOUT_S = 2.0  # a dial to a peer without a live connection
SEND_TIMEOUT_S = 2.0  # one message on a connection
REDIAL_BACKOFF_MAX = 4  # after failed dials, redial after election_timeout_min_s, doubling up to this many
                        # election_timeout_max_s: a dead peer costs a dial per timeout or less, and a
                        # healed partition reconnects within a few timeouts
SENDER_IDLE_S = 60.0  # a destination's sender task ends after this long without a message
MAX_PENDING_ACTIONS = 4096  # actions not yet executed; beyond it, incoming messages are dropped
MAX_ASKED = 32  # peers one find_coordinator asks (a random sample of more)
FINDER_ASKS = 3  # peers the background finder asks per round
FIND_EVERY = 5  # the background finder's period, in election_timeout_max_s

ElectionEvent = BecameCoordinator | CoordinatorKnown | SteppedDown


class ElectionService:
    """Runs one peer's `ElectionState` over a `PeerTransport`; see the module docstring."""

    def __init__(self, transport, me: bytes, store, config: ElectionConfig, *, signer: VoteSigner,
                 address_of: Callable[[bytes], tuple[str, int] | None] = lambda p: None,
                 rng: random.Random | None = None, wall_clock: Callable[[], float] = time.time,
                 peers: Callable[[], Iterable[bytes]] | None = None) -> None:
        self._transport = transport
        self.me = me
        self._short = short_id(me)
        self._store = store
        self._persist_inline = isinstance(store, MemoryElectionStore)  # no I/O: no thread needed
        self.config = config
        self._address_of = address_of
        self._wall_clock = wall_clock
        term, voted_for = store.load()
        self._state = ElectionState(me, config, rng or random.Random(), trio.current_time(), signer=signer,
                                    term=term, voted_for=voted_for)
        self._queued: tuple[int, bytes | None] = (term, voted_for)  # the last Persist queued (or loaded)
        self._durable: tuple[int, bytes | None] = (term, voted_for)  # the last Persist written (or loaded)
        self._actions: collections.deque[ElectionAction] = collections.deque()
        self._wake = trio.Event()  # set by every input; the loop waits on it
        self._changed = trio.Event()  # set (and replaced) when an event action is executed
        self._callbacks: list[Callable[[object], None]] = []
        self._outboxes: dict[bytes, trio.MemorySendChannel] = {}
        self._nursery: trio.Nursery | None = None
        self._running = False
        self._stopped = False
        self._failure: BaseException | None = None
        self._leading: int | None = None  # the term of an executed BecameCoordinator, until SteppedDown
        self._known: tuple[int, bytes | None] = (term, None)  # the last executed CoordinatorKnown
        self._role = self._state.role
        self._since = wall_clock()
        self._peers = peers
        self._sample = random.Random(me)  # which peers to ask (its own stream: the election's stays as seeded)

    # ------------------------------------------------------------------ queries

    @property
    def role(self) -> str:
        return self._state.role.value

    @property
    def term(self) -> int:
        return self._state.term

    @property
    def coordinator(self) -> bytes | None:
        return self._state.coordinator

    @property
    def voted_for(self) -> bytes | None:
        """Whom this peer voted for in the current term (what the store holds, or is writing)."""
        return self._state.voted_for

    @property
    def voters(self) -> tuple[bytes, ...]:
        return self._state.voters

    @property
    def council(self) -> Council | None:
        """The council (root and changes) the voters come from; None before this peer has one."""
        return self._state.council

    @property
    def last_applied(self) -> tuple[int, int]:
        return self._state.last_applied

    @property
    def certificate(self) -> Certificate | None:
        """The certificate of the recognised coordinator's election (this peer's own when it is
        the coordinator): what its allocations carry."""
        return self._state.certificate

    @property
    def is_follower(self) -> bool:
        return self._state.role is ElectionRole.FOLLOWER

    @property
    def is_coordinator(self) -> bool:
        """This peer is the coordinator of the current term, that is on disk, and the service runs."""
        return (self._leading == self._state.term and self._state.role is ElectionRole.COORDINATOR
                and not self._stopped)

    def status(self) -> dict:
        s = self._state
        out: dict[str, Any] = {"role": s.role.value, "term": s.term,
               "coordinator": None if s.coordinator is None else s.coordinator.hex(),
               "voters": len(s.voters), "applied": list(s.last_applied), "since": self._since,
               "term_exhausted": s.term_exhausted,
               "heard_of": None if s.heard_of is None else s.heard_of.candidate.hex()}
        if s.voters:
            # The council's health as gossip sees it: with fewer live voters than a quorum no
            # coordinator can be elected until the operator names a new council.
            live = set(self._peers()) | {self.me} if self._peers is not None else set(s.voters)
            out["quorum"] = s.quorum
            out["live_voters"] = sum(v in live for v in s.voters)
            out["gone_voters"] = [v.hex() for v in s.voters if v not in live]
        return out

    # ------------------------------------------------------------------ inputs from the control plane

    def set_voters(self, voters: Iterable[bytes]) -> None:
        """A first council taken on trust (tests; a daemon roots its council: `set_root`)."""
        self._input(self._state.set_voters, check_voters(sorted(voters)))

    def set_root(self, council: Council, *, rerooting: bool = False) -> None:
        """A council rooted by an operator's signed operation the caller checked (state.py)."""
        self._input(functools.partial(self._state.set_root, rerooting=rerooting), council)

    def council_for(self, voters: Iterable[bytes], epoch: int) -> Council | None:
        """The council of the allocation of `epoch` whose voters are to be `voters` (state.py `council_for`)."""
        return self._state.council_for(tuple(sorted(voters)), epoch)

    def restore(self, term: int, epoch: int, council: Council | None,
                previous: PreviousConfiguration | None = None) -> None:
        """At start: the allocation this peer applied before it stopped (its council), and the
        configuration before its last change, if it kept one."""
        self._input(functools.partial(self._state.restore, previous=previous), term, epoch, council)

    @property
    def previous(self) -> PreviousConfiguration | None:
        """The configuration before the last change, while a later coordinator may undo it
        (kept on disk with the applied allocation)."""
        return self._state.previous

    def apply_allocation(self, term: int, epoch: int, council: Council, certificate: Certificate | None) -> None:
        """An allocation this peer applies (`may_apply` said yes): (term, epoch), council, certificate."""
        self._input(self._state.apply_allocation, term, epoch, council, certificate)

    def learn(self, cert: Certificate) -> None:
        """A coordinator's certificate another peer sent (untrusted: state.py `learn` checks it
        against this peer's council before it recognises anyone)."""
        self._input(self._state.learn, cert)

    def campaign(self) -> None:
        """Stand now (`train start` on this peer) rather than at the election timer."""
        self._input(self._state.campaign)

    def may_apply(self, issuer: bytes, term: int, epoch: int, certificate: Certificate | None = None,
                  council: Council | None = None) -> Refusal | None:
        return self._state.may_apply(issuer, term, epoch, certificate, council)

    def on_event(self, cb: Callable[[object], None]) -> None:
        """Call `cb(action)` with each BecameCoordinator, SteppedDown and CoordinatorKnown, in
        order, from the service's loop, once the actions before it are executed."""
        self._callbacks.append(cb)

    async def changed(self) -> None:
        """Return at the next election event executed here (a coordinator known, elected, gone)."""
        await self._changed.wait()

    async def wait_for_coordinator(self, timeout_s: float) -> bytes | None:
        """The coordinator of the current term once it is known here; None after timeout_s."""
        with trio.move_on_after(timeout_s):
            while True:
                term, coordinator = self._known
                if coordinator is not None and term == self._state.term:
                    return coordinator
                await self._changed.wait()
        return None

    async def wait_until_coordinator(self, timeout_s: float) -> bool:
        """True once this peer is the coordinator; False after timeout_s."""
        with trio.move_on_after(timeout_s):
            while not self.is_coordinator:
                await self._changed.wait()
            return True
        return False

    # ------------------------------------------------------------------ running

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Handle ELECTION messages and run the election until cancelled. Raises the store's
        error when a Persist fails (after which nothing more is sent)."""
        if self._running or self._stopped:
            raise RuntimeError("ElectionService.run() may be called once")
        self._running = True
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._transport.handle(ControlMsg.ELECTION, self._on_message)
                self._transport.handle(ControlMsg.COORDINATOR, self._on_query)
                if self._peers is not None:
                    nursery.start_soon(self._finder)
                task_status.started()
                await self._loop()
                nursery.cancel_scope.cancel()  # the loop returns only when a Persist failed
        finally:
            self._stopped = True
            self._nursery = None
            self._wake_waiters()
        if self._failure is not None:
            raise self._failure

    async def _loop(self) -> None:
        while self._failure is None:
            if self._actions:
                await self._execute(self._actions.popleft())
                continue
            deadline = self._state.next_deadline()
            if trio.current_time() >= deadline:
                self._input(self._state.tick)
                await trio.lowlevel.checkpoint()
                continue
            self._wake = trio.Event()
            with trio.move_on_at(deadline):
                await self._wake.wait()

    def _input(self, call: Callable[..., list[ElectionAction]], *args) -> None:
        """One call into the state machine (with now), its actions queued for the loop; a
        refused input (see the module docstring) queues nothing but the machine's revert."""
        if self._stopped or self._failure is not None:
            return
        try:
            actions = call(*args, trio.current_time())
        except Exception:  # a bug the input ran into: refuse the input, keep the daemon
            logger.exception("%s: election input %s refused: the election machine raised", self._short,
                             getattr(call, "__name__", call))
            self._revert()
            return
        for a in actions:
            problem = persist_problem(a.term, a.voted_for) if isinstance(a, Persist) else None
            if problem is not None:
                logger.error("%s: election input %s refused: it would persist %s", self._short,
                             getattr(call, "__name__", call), problem)
                self._revert()
                return
        for a in actions:
            if isinstance(a, Persist):
                self._queued = (a.term, a.voted_for)
        self._actions.extend(actions)
        role = self._state.role
        if role is not self._role:
            logger.debug("%s: %s -> %s in term %d", self._short, self._role.value, role.value, self._state.term)
            self._role, self._since = role, self._wall_clock()
        self._wake.set()  # new actions, or a deadline that may have moved earlier

    def _revert(self) -> None:
        actions = self._state.revert(*self._queued, trio.current_time())
        self._actions.extend(actions)
        self._wake.set()

    async def _on_message(self, conn, msg_type: int, body: object, payload) -> None:
        msg = decode_election(body)  # ProtocolError: the transport closes the connection
        if payload is not None:
            raise ProtocolError("an election message carries no payload")
        if len(self._actions) >= MAX_PENDING_ACTIONS:
            logger.warning("%s: %d election actions pending, %s from %s dropped", self._short, len(self._actions),
                           type(msg).__name__, conn.short_id)
            return
        self._input(self._state.handle, conn.peer_id, msg)

    # ------------------------------------------------------------------ finding the coordinator

    @property
    def heard_of(self) -> bytes | None:
        """A coordinator learned of whose certificate this peer cannot check against its own
        council (state.py, `learn`): shown in status, never followed nor forwarded to."""
        cert = self._state.heard_of
        return None if cert is None else cert.candidate

    async def _on_query(self, conn, msg_type: int, body: object, payload) -> dict:
        if not isinstance(body, dict) or body or payload is not None:
            raise ProtocolError("a COORDINATOR question is an empty map")
        return self._state.answer(trio.current_time()).to_wire()

    async def find_coordinator(self, peers: Iterable[bytes], timeout_s: float) -> Discovery:
        """Ask `peers` who the coordinator is (module docstring): the coordinator this peer
        now recognises or heard of, else why none was found."""
        asked = sorted(set(peers) - {self.me})
        if len(asked) > MAX_ASKED:
            asked = sorted(self._sample.sample(asked, MAX_ASKED))
        answers: dict[bytes, CoordinatorAnswer | str] = {}

        async def ask(peer: bytes) -> None:
            try:
                with trio.fail_after(timeout_s):
                    conn = self._transport.connection(peer) or await self._dial(peer)
                    if conn is None:
                        answers[peer] = "unreachable"
                        return
                    reply, _ = await conn.request(ControlMsg.COORDINATOR, {}, timeout_s=timeout_s)
                    answers[peer] = CoordinatorAnswer.from_wire(reply)
            except trio.TooSlowError:
                answers[peer] = f"no answer within {timeout_s:g} s"
            except RequestTimeout:
                answers[peer] = f"no answer within {timeout_s:g} s"
            except (ProtocolError, ConnectionClosed, RemoteError, OSError) as e:
                answers[peer] = str(e) or type(e).__name__

        async with trio.open_nursery() as nursery:
            for p in asked:
                nursery.start_soon(ask, p)
        certs = [a.certificate for a in answers.values() if isinstance(a, CoordinatorAnswer) and a.certificate]
        for cert in sorted(certs, key=lambda c: -c.term):
            self._input(self._state.learn, cert)
        configured = sum(1 for a in answers.values() if isinstance(a, CoordinatorAnswer) and a.voters)
        found = self.me if self.is_coordinator else self._state.coordinator
        if found is not None:
            logger.debug("%s: asked %d peers: the coordinator is %s", self._short, len(asked), short_id(found))
            return Discovery(found, "", configured)
        return Discovery(None, explain(len(asked), answers, self._state.voters, self.me), configured)

    async def _finder(self) -> None:
        while True:
            await trio.sleep(FIND_EVERY * self.config.election_timeout_max_s)
            assert self._peers is not None
            if self.is_coordinator or self._state.answer(trio.current_time()).in_lease:
                continue
            peers = sorted(set(self._peers()) - {self.me})
            if peers:
                picked = self._sample.sample(peers, min(FINDER_ASKS, len(peers)))
                await self.find_coordinator(picked, DIAL_TIMEOUT_S + SEND_TIMEOUT_S)

    # ------------------------------------------------------------------ actions

    async def _execute(self, action: ElectionAction) -> None:
        if isinstance(action, ElectionSend):
            self._enqueue(action.to, action.msg)
        elif isinstance(action, Persist):
            await self._persist(action)
        else:
            self._publish(action)

    async def _persist(self, p: Persist) -> None:
        try:
            if self._persist_inline:
                self._store.persist(p.term, p.voted_for)
            else:
                await trio.to_thread.run_sync(self._store.persist, p.term, p.voted_for)
            self._durable = (p.term, p.voted_for)
        except ValueError as e:  # the store's own check (persist_problem), missed before queueing
            logger.error("%s: persist of term %d refused: %s; the actions after it are dropped", self._short,
                         p.term, e)
            self._actions.clear()
            self._queued = self._durable
            self._revert()
        except (ElectionStoreError, OSError) as e:  # anything else is a bug and propagates as one
            logger.error("%s: cannot persist term %d and vote: %s; the election service stops", self._short,
                         p.term, e)
            self._failure = e
            self._actions.clear()

    def _publish(self, event: ElectionEvent) -> None:
        if isinstance(event, BecameCoordinator):
            self._leading = event.term
            logger.info("%s: coordinator of term %d", self._short, event.term)
        elif isinstance(event, SteppedDown):
            self._leading = None
            logger.info("%s: stepped down in term %d: %s", self._short, event.term, event.reason)
        elif isinstance(event, CoordinatorKnown):
            self._known = (event.term, event.coordinator)
            if event.coordinator is not None and event.coordinator != self.me:
                logger.info("%s: following %s in term %d", self._short, short_id(event.coordinator), event.term)
        self._wake_waiters()
        for cb in self._callbacks:
            cb(event)

    def _wake_waiters(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # ------------------------------------------------------------------ sending

    def _enqueue(self, peer: bytes, msg: ElectionMessage) -> None:
        if peer == self.me or self._nursery is None:
            return
        box = self._outboxes.get(peer)
        if box is None:
            box, inbox = trio.open_memory_channel[ElectionMessage](OUTBOX_MESSAGES)
            self._outboxes[peer] = box
            self._nursery.start_soon(self._sender, peer, box, inbox)
        try:
            box.send_nowait(msg)
        except (trio.WouldBlock, trio.BrokenResourceError):  # full, or its sender was cancelled
            logger.debug("%s: outbox to %s full, %s dropped", self._short, short_id(peer), type(msg).__name__)

    async def _sender(self, peer: bytes, box: trio.MemorySendChannel,
                      inbox: trio.MemoryReceiveChannel) -> None:
        """Drain one destination's outbox until idle for SENDER_IDLE_S (or cancelled)."""
        first = self.config.election_timeout_min_s
        most = REDIAL_BACKOFF_MAX * self.config.election_timeout_max_s
        redial_at, backoff = -math.inf, first
        try:
            while True:
                msg = None
                with trio.move_on_after(SENDER_IDLE_S):
                    msg = await inbox.receive()
                if msg is None:
                    return  # idle, the outbox empty; forgotten below before any checkpoint
                conn = self._transport.connection(peer)
                if conn is None:
                    if trio.current_time() < redial_at:
                        logger.debug("%s: %s to %s dropped: no connection", self._short, type(msg).__name__,
                                     short_id(peer))
                        continue
                    conn = await self._dial(peer)
                    if conn is None:
                        redial_at, backoff = trio.current_time() + backoff, min(2 * backoff, most)
                        continue
                    backoff = first
                await self._send(conn, msg)
        finally:
            if self._outboxes.get(peer) is box:
                del self._outboxes[peer]
            box.close()
            inbox.close()

    async def _dial(self, peer: bytes):
        address = self._address_of(peer)
        if address is None:
            logger.debug("%s: no address for %s: election message dropped", self._short, short_id(peer))
            return None
        try:
            with trio.fail_after(DIAL_TIMEOUT_S):
                return await self._transport.connect(*address, peer_id=peer)
        except (OSError, trio.TooSlowError, HandshakeError, ConnectionClosed) as e:
            logger.debug("%s: cannot reach %s at %s:%d: %s", self._short, short_id(peer), *address, e)
            return None

    async def _send(self, conn, msg: ElectionMessage) -> None:
        try:
            with trio.fail_after(SEND_TIMEOUT_S):
                await conn.send(ControlMsg.ELECTION, msg.to_wire(), droppable=True)
        except (ConnectionClosed, trio.TooSlowError, OSError) as e:
            logger.debug("%s: %s to %s dropped: %s", self._short, type(msg).__name__, conn.short_id, e)
