"""Block hashes: chained, position-aware, scoped, deterministic across processes, collision-resistant by default."""

import subprocess
import sys

import numpy as np
import pytest

from kvproc import DEFAULT_HASH, PAD_TOKEN_ID, BlockHasher, HashAlgorithm, HashScope


@pytest.fixture(params=list(HashAlgorithm))
def hasher(request):
    return BlockHasher(16, request.param)


def test_only_full_pages_are_hashed(hasher):
    assert len(hasher.hash_prompt(list(range(47)))) == 2
    assert len(hasher.hash_prompt(list(range(48)))) == 3
    assert all(len(h) == 16 for h in hasher.hash_prompt(list(range(48))))


def test_hashes_are_chained_so_equal_pages_at_other_positions_differ(hasher):
    page = list(range(16))
    h = hasher.hash_prompt(page + page)
    assert h[0] != h[1]


def test_shared_prefix_gives_shared_hashes_then_diverges(hasher):
    a = hasher.hash_prompt(list(range(64)))
    b = hasher.hash_prompt(list(range(48)) + [9] * 16)
    assert a[:3] == b[:3] and a[3] != b[3]


def test_scope_separates_tenants(hasher):
    toks = list(range(32))
    assert hasher.hash_prompt(toks, HashScope(cache_salt="a")) != hasher.hash_prompt(toks, HashScope(cache_salt="b"))
    assert hasher.hash_prompt(toks, HashScope(lora_name="x")) != hasher.hash_prompt(toks)
    assert hasher.hash_prompt(toks, HashScope(extra_keys=("img1",))) != hasher.hash_prompt(toks)
    # length-prefixed parts: moving a character between fields changes the seed
    assert hasher.seed(HashScope(cache_salt="ab")) != hasher.seed(HashScope(cache_salt="a", lora_name="b"))


def test_continuing_a_chain_equals_hashing_the_whole(hasher):
    toks = list(range(80))
    whole = hasher.hash_prompt(toks)
    head = hasher.hash_prompt(toks[:32])
    assert head + hasher.hash_prompt(toks[32:], parent=head[-1]) == whole


def test_algorithms_are_distinct_families():
    toks = list(range(32))
    outs = {a: BlockHasher(16, a).hash_prompt(toks)[0] for a in HashAlgorithm}
    assert len(set(outs.values())) == len(outs)


def test_default_is_collision_resistant():
    # SHA-256-128: collision-resistant, and the fastest such chain where the CPU has SHA extensions (XXH3 never is).
    assert BlockHasher(16).algorithm is HashAlgorithm.SHA256_128 is DEFAULT_HASH


def test_numpy_and_list_inputs_hash_the_same(hasher):
    toks = list(range(32))
    assert hasher.hash_prompt(np.array(toks, dtype=np.int64)) == hasher.hash_prompt(toks)
    assert hasher.hash_prompt(np.array(toks, dtype=np.int32)) == hasher.hash_prompt(toks)


def test_pad_token_is_hashable_only_as_a_padded_tail_and_out_of_range_ids_are_rejected(hasher):
    assert hasher.hash_prompt([1] * 15 + [PAD_TOKEN_ID], pad_tail=True)
    # A user prompt may not name the pages of a producer's padded hand-off chain (`>` where `>=` was meant).
    with pytest.raises(ValueError, match="reserved pad id"):
        hasher.hash_prompt([1] * 15 + [PAD_TOKEN_ID])
    with pytest.raises(ValueError, match="reserved pad id"):
        hasher.hash_prompt([1] * 15 + [PAD_TOKEN_ID], parent=b"\0" * 16)
    # Padding is a tail of less than a page: a pad id inside the prompt, or a whole page of them, is refused.
    with pytest.raises(ValueError, match="reserved pad id"):
        hasher.hash_prompt([PAD_TOKEN_ID] + [1] * 14 + [PAD_TOKEN_ID], pad_tail=True)
    with pytest.raises(ValueError, match="less than one page"):
        hasher.hash_prompt([1] * 16 + [PAD_TOKEN_ID] * 16, pad_tail=True)
    with pytest.raises(ValueError, match="token ids must lie"):
        hasher.hash_prompt([-1] * 16)
    with pytest.raises(ValueError, match="token ids must lie"):
        hasher.hash_prompt([PAD_TOKEN_ID + 1] * 16)


def test_hashes_are_deterministic_across_processes_and_hash_seeds():
    code = (
        "from kvproc import BlockHasher, HashAlgorithm\n"
        "for a in HashAlgorithm: print(BlockHasher(16, a).hash_prompt(list(range(64)))[-1].hex())"
    )
    outs = set()
    for seed in ("0", "12345"):
        env = {"PYTHONHASHSEED": seed, "PATH": ""}
        outs.add(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                                check=True).stdout)
    assert len(outs) == 1
    here = "".join(BlockHasher(16, a).hash_prompt(list(range(64)))[-1].hex() + "\n" for a in HashAlgorithm)
    assert outs.pop() == here
