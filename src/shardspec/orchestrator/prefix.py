"""The prefix cache: K/V blocks and saved recurrent states that later requests start from.

Full K/V blocks of committed tokens stay on the workers after their sequence ends, in a tree keyed
by a hash chain (each block's key hashes its parent's key and its tokens). A Gated DeltaNet layer's
state holds for one exact position only, so the workers also save recurrent states (and, with MTP,
the target's hidden state before the position) where a later request is likely to start:

- after the last full block of each prompt before its last token (the same prompt again, a longer
  one that starts with it), unless its prefill starts at a hit less than SHORT_TAIL before that: a
  cached turn's short prefill then runs as one pass, not two;
- where a prompt leaves the cached chain of blocks deeper than any saved state (a shared system
  prompt: the second request that shares it saves the state at the end of what they share);
- at the end of each finished sequence, its last block partly full (the next turn of a chat, which
  sends the conversation so far and a new message).

A hit is the deepest saved state whose position a new prompt reaches through cached blocks (and
whose partial block's tokens it repeats), short of the prompt's last token. Its sequence shares the
cached blocks before that position and prefills from there: the workers restore the saved state,
and copy the block that holds the position before it where the sequence must write into it (a
partial block; with MTP, the draft layer's entry for that position pairs it with the token after).

Only committed tokens enter a cached block or a saved state, and cached blocks are never written
again: a step writes past its sequences' committed positions, drafts included. The orchestrator
alone decides (hits, saves, evictions) and tells every rank of every stage the same, so they agree.

Tenants: requests share blocks and states only with requests of the same cache salt (vLLM's
`cache_salt`; None: the shared pool), each salt a tree of its own under its own root, so a prompt of
one salt is never a hit for another (nor its `cached_tokens`, nor its time to first token).

Eviction takes blocks that no sequence holds, a chain's deepest first, with the saved states that
depend on them: the least recently used of the tenant that holds the most such blocks (of equals, the
one admitted last, then the one used least recently), and a saved state likewise. A tenant thus takes
from another only what that one holds beyond its own: one flooding the cache evicts its own first,
and one alone may fill it (without salts, plain LRU). Every sequence holds the cached blocks of its
chain, so a block no sequence holds has none below it that one does.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from shardspec.orchestrator.blocks import BlockPool
from shardspec.orchestrator.requests import Request
from shardspec.protocol.messages import SaveAt, SaveFinished

MAX_CACHE_SALT = 256  # characters of a request's cache_salt (each salt the cache holds is a key of its own)
SHORT_TAIL = 256  # positions: see PrefixCache._plan_saves


@dataclass(eq=False)
class Node:
    """A cached block (the root: none): its chain key, its block id, the states saved at its end or
    partway through the block after it (by that block's tokens up to the state)."""

    key: bytes
    block: int
    parent: Node | None
    depth: int  # blocks from the root to it, it included
    tenant: Tenant = field(repr=False)
    children: dict[bytes, Node] = field(default_factory=dict)
    points: dict[tuple[int, ...], StatePoint] = field(default_factory=dict)
    users: int = 0  # sequences whose chain holds it


@dataclass(eq=False)
class StatePoint:
    """A saved recurrent state at `node`'s end plus `tail` tokens, which partial block `tail_block`
    holds (-1: none)."""

    node: Node
    tail: tuple[int, ...]
    tail_block: int
    state: int
    users: int = 0  # prefills starting from it, until their first reply

    def length(self, block_tokens: int) -> int:
        return self.node.depth * block_tokens + len(self.tail)

    @property
    def tenant(self) -> Tenant:
        return self.node.tenant


@dataclass(eq=False)
class Tenant:
    """The cache of the requests of one salt (None: those without one), shared with no other: its tree,
    the blocks that only the cache holds (`unused`; `idle`: those evictable now, oldest first) and its
    saved states, least recently used first."""

    salt: str | None
    root: Node = field(init=False)
    idle: OrderedDict[Node | StatePoint, None] = field(default_factory=OrderedDict)
    points: OrderedDict[StatePoint, None] = field(default_factory=OrderedDict)
    unused: int = 0
    requests: int = 0  # admitted and not yet released: while any is, it is kept even when empty
    used_at: int = 0  # when its last request was admitted (PrefixCache.admissions)

    def __post_init__(self) -> None:
        self.root = Node(b"", -1, None, 0, self, users=1)  # (never evicted)

    @property
    def empty(self) -> bool:
        return not (self.root.children or self.root.points or self.requests)


@dataclass
class Hit:
    """Where a prefill starts: `length` cached positions from saved state `point`, the first
    `shared` blocks of the chain `nodes` (all the cached blocks its prompt reaches) in its table, its
    next block copied from `copy_from` (-1: none)."""

    nodes: list[Node] = field(default_factory=list)
    point: StatePoint | None = None
    length: int = 0
    shared: int = 0
    copy_from: int = -1


@dataclass
class CacheUse:
    """A request's part in the prefix cache while it runs: the chain of cached blocks it holds (those
    of its table and any more its prompt matched), the saved state its prefill starts from and the
    states it saves on the way (both until its first reply)."""

    tenant: Tenant
    chain: list[Node] = field(default_factory=list)
    point: StatePoint | None = None
    saves: list[SaveAt] = field(default_factory=list)


class PrefixCache:
    """The tree of cached blocks and the saved states of one load of the workers (Paging.states of
    them). Disabled (`enabled` false), it holds nothing: every prefill starts at 0."""

    def __init__(self, pool: BlockPool, states: int, mtp: bool, keeps_finished_state: bool, enabled: bool = True,
                 one_pass_tokens: int = 0):
        self.pool = pool
        self.one_pass_tokens = one_pass_tokens  # Paging.one_pass_tokens
        self.block_tokens = pool.paging.block_tokens
        self.mtp = mtp
        self.enabled = enabled and states > 0
        self.finish_states = keeps_finished_state
        self.shared = Tenant(None)
        self.tenants: dict[str | None, Tenant] = {None: self.shared}
        self.free_states = list(range(states - 1, -1, -1))
        self.unused = 0  # blocks held by the cache alone, of every tenant: what evictions can free
        self.queries = self.hits = 0  # prompt tokens looked up, found
        self.admissions = 0
        pool.evict, pool.evictable = self._evict, lambda: self.unused

    @property
    def root(self) -> Node:
        """The tree of the requests without a salt."""
        return self.shared.root

    # --- admission ----------------------------------------------------------------------------------

    def admit(self, request: Request, needed: int) -> bool:
        """Give a request about to prefill `needed` blocks in all: the cached ones its longest hit
        shares and fresh ones, and plan the states its prefill saves. False (nothing held) when the
        pool cannot."""
        use = CacheUse(self._enter(request.cache_salt if self.enabled else None))
        tokens = request.prefill_ids()
        hit = self._lookup(use.tenant, request, tokens) if self.enabled and request.prompt_logprobs < 0 else Hit()
        for node in hit.nodes:
            self._use(node)
        if hit.point is not None:
            self._use(hit.point)
        fresh = self.pool.take(needed - hit.shared)
        if fresh is None and (hit.nodes or hit.point is not None):
            # the hit may hold the only blocks the pool could evict for it (nothing running): start cold
            self._drop_use(hit.nodes, hit.point)
            hit = Hit()
            fresh = self.pool.take(needed)
        if fresh is None:
            self._drop_use(hit.nodes, hit.point)
            self._leave(use.tenant)
            return False
        for node in hit.nodes[: hit.shared]:
            self.pool.hold(node.block)
        request.blocks = [node.block for node in hit.nodes[: hit.shared]] + fresh
        use.chain, use.point = hit.nodes, hit.point
        request.cache = use
        request.cached, request.copy_from = hit.length, hit.copy_from
        request.restore = hit.point.state if hit.point is not None else -1
        if not request.preemptions:
            request.cached_tokens = hit.length
        if self.enabled:
            use.saves = self._plan_saves(len(tokens), hit, request.prefix_points)
            self.queries += len(tokens)
            self.hits += hit.length
        return True

    def _enter(self, salt: str | None) -> Tenant:
        """The tenant of a request being admitted, held until its release (eviction may empty it meanwhile)."""
        tenant = self.tenants.get(salt) or self.tenants.setdefault(salt, Tenant(salt))
        tenant.requests += 1
        self.admissions += 1
        tenant.used_at = self.admissions
        return tenant

    def _leave(self, tenant: Tenant) -> None:
        tenant.requests -= 1
        self._forget_if_empty(tenant)

    def _forget_if_empty(self, tenant: Tenant) -> None:
        if tenant.salt is not None and tenant.empty:  # (a salt used once must not stay forever)
            del self.tenants[tenant.salt]

    def _lookup(self, tenant: Tenant, request: Request, tokens: list[int]) -> Hit:
        """The longest hit of a prompt in its tenant's tree: the deepest saved state its cached blocks
        reach, short of its last token (which must prefill)."""
        bt, limit = self.block_tokens, len(tokens) - 1
        best = self._best_point(tenant.root, tokens, limit, None)
        node, nodes = tenant.root, []
        for key in self._hashes(request, tokens, len(tokens) // bt):
            node = node.children.get(key)
            if node is None:
                break
            nodes.append(node)
            best = self._best_point(node, tokens, limit, best)
        if best is None:
            return Hit(nodes)
        length = best.length(bt)
        depth = best.node.depth
        if best.tail:  # its partial block: a copy of the one the state's sequence left
            return Hit(nodes, best, length, depth, best.tail_block)
        if self.mtp:  # the draft layer rewrites the entry of the position before: a copy of its block
            return Hit(nodes, best, length, depth - 1, nodes[depth - 1].block)
        return Hit(nodes, best, length, depth)

    def _best_point(self, node: Node, tokens: list[int], limit: int, best: StatePoint | None) -> StatePoint | None:
        start = node.depth * self.block_tokens
        for tail, point in node.points.items():
            end = start + len(tail)
            if end <= limit and tuple(tokens[start:end]) == tail and (
                    best is None or end > best.length(self.block_tokens)):
                best = point
        return best

    def _plan_saves(self, length: int, hit: Hit, points: list[int] = ()) -> list[SaveAt]:
        """The states a prefill of `length` tokens starting at the hit saves: after the last full block
        before its last token, where its prompt leaves the cached blocks, and at the block boundary at
        or before each of the request's prefix points (where other prompts may part from it: a system
        prompt's end), when deeper than the hit; none that are saved already, or that no saved state
        can be freed for."""
        bt = self.block_tokens
        last = (length - 1) // bt * bt
        # (a prefill that starts at a hit within SHORT_TAIL of its last full block saves nothing there:
        # the same prompt again would start at the hit, at the cost of those few tokens, while the save
        # would split this prefill, a short one, into two passes; unless the workers run it as one pass
        # with that save within it, and it saves nothing else)
        ends = [last] if not hit.length or last - hit.length >= SHORT_TAIL else []
        positions = {*ends, min(len(hit.nodes) * bt, last), *(min(p // bt * bt, last) for p in points)}
        if hit.length and length - hit.length <= self.one_pass_tokens and all(p <= hit.length for p in positions):
            positions.add(last)
        saves = []
        for position in sorted(p for p in positions if p > hit.length):
            depth = position // bt
            if depth <= len(hit.nodes) and () in hit.nodes[depth - 1].points:
                continue
            state = self._take_state()
            if state is None:
                break
            saves.append(SaveAt(position, state))
        return saves

    # --- as the sequences advance ---------------------------------------------------------------------

    def prefilled(self, request: Request) -> None:
        """After a request's first reply: its prefill has run on every worker, so the states it
        saved are there to start from, and the one it started from may be evicted."""
        use = request.cache
        if use is None:
            return
        self.advance(request)
        for save in use.saves:
            depth = save.position // self.block_tokens
            node = use.chain[depth - 1]
            if () in node.points:
                self.free_states.append(save.state)
            else:
                self._add_point(StatePoint(node, (), -1, save.state))
        use.saves = []
        if use.point is not None:
            self._release_item(use.point)
            use.point = None

    def advance(self, request: Request, length: int | None = None, tokens: list[int] | None = None) -> None:
        """Cache the blocks a request has filled with committed tokens: the first `length` of `tokens`
        (by default its known length of its prompt and output; the list is built only when a block
        is full, not at every step)."""
        use, bt = request.cache, self.block_tokens
        length = request.known_length() if length is None else length
        if use is None or not self.enabled or (len(use.chain) + 1) * bt > length:
            return
        tokens = request.prompt + request.output if tokens is None else tokens
        while (len(use.chain) + 1) * bt <= length:  # (its chain is held: never evicted)
            depth = len(use.chain)
            parent = use.chain[-1] if use.chain else use.tenant.root
            key = self._hashes(request, tokens, depth + 1)[depth]
            node = parent.children.get(key)
            if node is None:
                node = Node(key, request.blocks[depth], parent, depth + 1, use.tenant)
                self.pool.hold(node.block)
                use.tenant.idle.pop(parent, None)  # (no longer a leaf)
                parent.children[key] = node
                self._count_unused(use.tenant, 1)  # (until _use below)
            self._use(node)
            use.chain.append(node)

    def finish(self, request: Request) -> SaveFinished | None:
        """A finished request's last blocks cached, and the state at its end saved where the workers
        keep it (the release then saves it)."""
        use, bt = request.cache, self.block_tokens
        if use is None or not self.enabled:
            return None
        tokens = request.committed_tokens()
        self.advance(request, len(tokens), tokens)
        depth = len(tokens) // bt
        if not self.finish_states:
            return None
        node = use.chain[depth - 1] if depth else use.tenant.root
        tail = tuple(tokens[depth * bt :])
        if tail in node.points:
            return None
        state = self._take_state()
        if state is None:
            return None
        tail_block = -1
        if tail:  # the partial block, kept for hits to copy
            tail_block = request.blocks[depth]
            self.pool.hold(tail_block)
        self._add_point(StatePoint(node, tail, tail_block, state))
        return SaveFinished(request.seq, state)

    def release(self, request: Request) -> None:
        """A request ends or gives its blocks back (finished, cancelled, preempted, refused)."""
        use = request.cache
        self.pool.give_back(request.blocks)
        request.blocks, request.cache = [], None
        if use is not None:
            self.free_states.extend(save.state for save in use.saves)
            self._drop_use(use.chain, use.point)
            self._leave(use.tenant)

    def forget(self, states: list[int]) -> None:
        """Drop the saved states `states` (their save failed); a prefill already starting from one
        keeps it until its first reply."""
        points = [p for t in self.tenants.values() for p in t.points if p.state in states and p.users == 0]
        for point in points:
            self._drop_point(point)

    # --- holding and evicting -----------------------------------------------------------------------

    def _use(self, item: Node | StatePoint) -> None:
        tenant = item.tenant
        if item.users == 0 and (isinstance(item, Node) or item.tail_block >= 0):
            self._count_unused(tenant, -1)
        item.users += 1
        tenant.idle.pop(item, None)
        if isinstance(item, StatePoint):
            tenant.points.move_to_end(item)

    def _release_item(self, item: Node | StatePoint) -> None:
        item.users -= 1
        if item.users:
            return
        if isinstance(item, Node):
            self._count_unused(item.tenant, 1)
            if not item.children:
                item.tenant.idle[item] = None
        elif item.tail_block >= 0:
            self._count_unused(item.tenant, 1)
            item.tenant.idle[item] = None

    def _count_unused(self, tenant: Tenant, n: int) -> None:
        tenant.unused += n
        self.unused += n

    def _drop_use(self, nodes: list[Node], point: StatePoint | None) -> None:
        for node in reversed(nodes):  # (the deepest first: idle in eviction order)
            self._release_item(node)
        if point is not None:
            self._release_item(point)

    def _add_point(self, point: StatePoint) -> None:
        point.node.points[point.tail] = point
        point.tenant.points[point] = None
        if point.tail_block >= 0:
            self._count_unused(point.tenant, 1)
            point.tenant.idle[point] = None

    def _take_state(self) -> int | None:
        """A saved state's id: a free one, or that of the least recently used one no prefill starts
        from, of the tenant that holds the most saved states (of equals, as _evict picks)."""
        if not self.free_states:
            tenants = sorted(self.tenants.values(), key=lambda t: self._precedence(t, len(t.points)), reverse=True)
            victim = next((p for t in tenants for p in t.points if p.users == 0), None)
            if victim is None:
                return None
            self._drop_point(victim)
        return self.free_states.pop()

    def _evict(self) -> bool:
        """Free one block that only the cache holds: the least recently used of the tenant that holds
        the most such blocks; False when there is none."""
        tenant = max(self.tenants.values(), key=lambda t: self._precedence(t, t.unused))
        if not tenant.unused:
            return False
        item = next(iter(tenant.idle))
        if isinstance(item, StatePoint):
            self._drop_point(item)
        else:
            self._drop_node(item)
        return True

    def _precedence(self, tenant: Tenant, held: int) -> tuple[int, bool, int]:
        """Which tenant gives up a block or state first: the one that holds the most; of equals, the one
        admitted last (usually the one asking: a tenant takes from another only what that one holds
        beyond its own), then the one used least recently."""
        return held, tenant.used_at == self.admissions, -tenant.used_at

    def _drop_point(self, point: StatePoint) -> None:
        tenant = point.tenant
        del point.node.points[point.tail]
        del tenant.points[point]
        self.free_states.append(point.state)
        if point.tail_block >= 0:
            if point.users == 0:
                self._count_unused(tenant, -1)
            tenant.idle.pop(point, None)
            self.pool.give_back([point.tail_block])
        self._forget_if_empty(tenant)

    def _drop_node(self, node: Node) -> None:
        """Evict a cached block no sequence holds and nothing below it, with the states at its end."""
        tenant = node.tenant
        for point in list(node.points.values()):
            self._drop_point(point)
        tenant.idle.pop(node, None)
        self._count_unused(tenant, -1)
        parent = node.parent
        del parent.children[node.key]
        self.pool.give_back([node.block])
        if parent.depth and parent.users == 0 and not parent.children:
            tenant.idle[parent] = None
        self._forget_if_empty(tenant)

    # --- hashing --------------------------------------------------------------------------------------

    def _hashes(self, request: Request, tokens: list[int], blocks: int) -> list[bytes]:
        """The chain keys of the first `blocks` full blocks of a request's `tokens` (kept on the request:
        its tokens only grow)."""
        bt, hashes = self.block_tokens, request.block_hashes
        while len(hashes) < blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else b""
            block = array("q", tokens[i * bt : (i + 1) * bt]).tobytes()
            hashes.append(hashlib.blake2b(parent + block, digest_size=16).digest())
        return hashes
