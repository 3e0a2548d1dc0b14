"""Cache salts: requests share the prefix cache only with requests of the same salt, and one salt
flooding the cache evicts its own blocks first. The tree and the eviction rule on the PrefixCache
alone, then an engine (the same greedy tokens with salts as without), then one `shardspec serve
--cache-salt from-key` driven over HTTP."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
from conftest import pooled
from test_prefix_cache import run
from test_server import start_server

import shardspec
from shardspec.cli import build_parser
from shardspec.cli.commands import _serve_options
from shardspec.orchestrator.blocks import BlockPool, Paging
from shardspec.orchestrator.prefix import MAX_CACHE_SALT, PrefixCache
from shardspec.orchestrator.requests import Request
from shardspec.protocol.messages import SamplingParams
from shardspec.server.api import ApiError
from shardspec.server.cache_salts import CacheSalts

BT = 32


def cache(blocks: int = 64, states: int = 4) -> PrefixCache:
    return PrefixCache(BlockPool(Paging(blocks, BT, 4, 1 << 20, states, True)), states, False, True)


def request(tokens: list[int], salt: str | None, seq: int = 0) -> Request:
    r = Request(seq, list(tokens), 100, SamplingParams(), [], 0)
    r.cache_salt = salt
    return r


def hit(c: PrefixCache, tokens: list[int], salt: str | None, blocks: int = 4) -> int:
    """The cached tokens a prompt would start from (the request is released again)."""
    r = request(tokens, salt, 99)
    assert c.admit(r, blocks)
    c.release(r)
    return r.cached


# --- the tree and the eviction rule ------------------------------------------------------------------


def test_a_prompt_is_a_hit_only_for_requests_of_the_salt_that_cached_it():
    c, prompt = cache(), list(range(100))
    run(c, request(prompt, "a"), [7], 4)
    assert hit(c, prompt, "b") == 0 and hit(c, prompt, None) == 0
    assert hit(c, prompt, "a") == 96


def test_a_state_saved_before_the_first_full_block_is_not_shared_across_salts():
    """A sequence shorter than a block leaves its state at its tenant's root, not at a root all share."""
    c = cache()
    run(c, request(range(10), "a"), [50, 51], 1)  # its state at 11, in a partial block
    follow = [*range(10), 50, 51, 52]
    assert hit(c, follow, "b", 1) == 0 and hit(c, follow, None, 1) == 0
    assert hit(c, follow, "a", 1) == 11


def flood_then_next_turn(flooder: str | None) -> int:
    """The victim's chat turn (70 tokens + 6) cached, then 12 unique 100-token prompts of `flooder`
    through a pool of 24 blocks and 4 saved states: the cached tokens of the victim's next turn."""
    c, rng = cache(blocks=24, states=4), random.Random(0)
    chat = rng.choices(range(16), k=70)
    run(c, request(chat, "victim"), [1, 2, 3, 4, 5, 6], 3)  # blocks 0-1, its tail block; states at 64 and 75
    for i in range(12):
        run(c, request(rng.choices(range(16), k=100), flooder, i + 1), [9, 9], 4)
    return hit(c, [*chat, 1, 2, 3, 4, 5, 6, 40, 41], "victim")


def test_a_tenant_flooding_unique_prompts_evicts_its_own_blocks_and_states_not_another_tenant_s_chat():
    assert flood_then_next_turn("flooder") == 75  # the chat's end: its blocks and state kept
    assert flood_then_next_turn("victim") < 64  # one tenant (as without salts): least recently used first


def test_eviction_takes_from_the_tenant_holding_the_most_unused_blocks_and_of_equals_from_the_last_admitted():
    c, rng = cache(blocks=9, states=8), random.Random(1)

    def held() -> tuple[int, ...]:
        return tuple(c.tenants[salt].unused for salt in "abc" if salt in c.tenants)

    for salt in ("a", "b", "a"):  # each: 2 full blocks and a partial one cached
        run(c, request(rng.choices(range(16), k=64), salt), [1, 2], 3)
    assert held() == (6, 3) and not c.pool.free
    run(c, request(rng.choices(range(16), k=64), "b"), [1, 2], 3)  # b asks, a holds the most: a's go
    assert held() == (3, 6)
    run(c, request(rng.choices(range(16), k=64), "c"), [1, 2], 3)  # c holds nothing, b the most: b's go
    assert held() == (3, 3, 3)
    short = request(range(20), "a")
    assert c.admit(short, 1) and held() == (2, 3, 3)  # all equal: a's, the one admitted last
    c.release(short)


def test_a_salt_is_forgotten_once_nothing_of_it_is_cached_or_running():
    c = cache(blocks=7)
    short = request(range(5), "once")
    assert c.admit(short, 1) and "once" in c.tenants
    c.release(short)  # (never replied to: nothing cached)
    assert "once" not in c.tenants
    run(c, request(range(64), "kept"), [1, 2], 3)
    assert c.tenants["kept"].unused == 3
    run(c, request(range(200, 420), "big"), [1], 7)  # takes the whole pool: kept's blocks evicted
    assert "kept" not in c.tenants and None in c.tenants


# --- the server's modes ----------------------------------------------------------------------------


def test_the_server_s_modes_pass_a_salt_through_require_one_or_derive_it_from_the_api_key():
    optional, required, from_key = CacheSalts("optional"), CacheSalts("required"), CacheSalts("from-key")
    assert optional.salt("Bearer k", None) is None and optional.salt(None, "s") == "s"
    assert required.salt(None, "s") == "s"
    alice = from_key.salt("Bearer alice", None)
    assert alice == from_key.salt("bearer  alice ", None) != from_key.salt("Bearer bob", None)
    assert "alice" not in alice and alice != CacheSalts("from-key").salt("Bearer alice", None)  # keyed per server
    refusals = [(required, "Bearer k", None, 400, "cache_salt"), (from_key, "Bearer k", "s", 400, "cache_salt"),
                (from_key, None, None, 401, None), (from_key, "Basic k", None, 401, None)]
    for salts, header, given, status, param in refusals:
        with pytest.raises(ApiError) as refused:
            salts.salt(header, given)
        assert (refused.value.status, refused.value.param) == (status, param)


def test_serve_takes_cache_salt_optional_by_default_and_refuses_another_mode(capsys):
    parse = build_parser().parse_args
    assert _serve_options(parse(["serve"])).cache_salt == "optional"
    assert _serve_options(parse(["serve", "--cache-salt", "from-key"])).cache_salt == "from-key"
    with pytest.raises(SystemExit):
        parse(["serve", "--cache-salt", "per-user"])
    assert "--cache-salt" in capsys.readouterr().err


# --- an engine: the same tokens with salts as without --------------------------------------------


def test_greedy_tokens_are_the_same_under_any_salt_and_only_the_same_salt_hits(small_vocab_model):
    prompt = random.Random(3).choices(range(16), k=80)

    async def main():
        async with shardspec.connect(model=str(small_vocab_model), workers=pooled(1), deterministic=True,
                                     max_seq_len=256, max_seqs=4) as engine:  # (4 saved states)
            results = [await generate(engine, prompt, salt) for salt in ("a", "b", "a", "b", None)]
            for bad in ("", "x" * (MAX_CACHE_SALT + 1), 7):
                with pytest.raises(ValueError, match="cache_salt"):
                    await generate(engine, prompt, bad)
            return results

    results = asyncio.run(main())
    assert all(tokens == results[0][0] for tokens, _ in results)
    assert [cached for _, cached in results] == [0, 0, 64, 64, 0]


async def generate(engine, prompt, salt):
    tokens, cached = [], None
    async for chunk in engine.generate(prompt, max_tokens=8, stop_at_eos=False, cache_salt=salt):
        tokens += chunk.token_ids
        cached = chunk.cached_tokens if chunk.cached_tokens is not None else cached
    return tokens, cached


# --- one server: salts from API keys ----------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    """The bundled model, a cache of 4 x 5 blocks and 4 saved states, salts from API keys."""
    started = start_server(tmp_path_factory.mktemp("keyed"), "--local", "1", "--cache-salt", "from-key",
                           "--max-seqs", "4", "--max-seq-len", "128")
    yield started
    assert started.stop() == 0, started.log.read_text(errors="replace")


def complete(server, prompt: list[int], key: str | None, max_tokens: int = 8, **body) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}/completions", headers=headers, timeout=120,
                      json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **body})


def answer(response: httpx.Response) -> tuple[str, int]:
    assert response.status_code == 200, response.text
    body = response.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_two_api_keys_share_no_cached_prompt_and_get_the_same_tokens(keyed_server):
    prompt = random.Random(5).choices(range(1, 4096), k=100)
    alice, again, bob = (answer(complete(keyed_server, prompt, key)) for key in ("alice", "alice", "bob"))
    assert (alice[1], again[1], bob[1]) == (0, 96, 0)
    assert alice[0] == again[0] == bob[0]


@pytest.mark.parametrize(("key", "body", "status", "param"), [
    (None, {}, 401, None),
    ("alice", {"cache_salt": "mine"}, 400, "cache_salt"),
    ("alice", {"cache_salt": ""}, 400, "cache_salt"),
    ("alice", {"cache_salt": "x" * (MAX_CACHE_SALT + 1)}, 400, "cache_salt"),
    ("alice", {"cache_salt": 7}, 400, "cache_salt"),
])
def test_a_request_without_a_key_or_with_a_salt_of_its_own_is_refused_naming_it(keyed_server, key, body, status,
                                                                                param):
    response = complete(keyed_server, [1, 2, 3], key, **body)
    assert response.status_code == status and response.json()["error"]["param"] == param


def test_a_key_flooding_unique_prompts_leaves_another_key_s_conversation_cached(keyed_server):
    rng = random.Random(6)
    chat = rng.choices(range(1, 4096), k=100)
    assert answer(complete(keyed_server, chat, "carol", max_tokens=1))[1] == 0  # its state at 100 saved
    flood = [rng.choices(range(1, 4096), k=120) for _ in range(6)]  # 4 blocks each: more than the cache
    for prompt in flood:
        answer(complete(keyed_server, prompt, "mallory", max_tokens=1))
    assert answer(complete(keyed_server, flood[0], "mallory", max_tokens=1))[1] == 0  # evicted: its own
    assert answer(complete(keyed_server, [*chat, 7, 8, 9], "carol"))[1] == 100  # the next turn still hits
