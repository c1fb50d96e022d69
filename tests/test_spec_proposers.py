"""Draft proposers (engine_service/spec_decode): n-gram prompt lookup and suffix decoding,
checked against brute-force references over fresh random sequences."""

from __future__ import annotations

import random
from collections import Counter, defaultdict

import numpy as np
import pytest

from engine_service.spec_decode.ngram import NgramProposer
from engine_service.spec_decode.suffix import _POS_BITS, _POS_MASK, SuffixProposer, _SuffixTrie

# ----------------------------------------------------------------------------- n-gram


def _ngram_ref(tokens: list[int], min_n: int, max_n: int, k: int, max_tokens: int) -> list[int]:
    """Brute force: longest n in [min_n, max_n]; of the tail n-gram's earlier occurrences the
    latest with k tokens after it, else the earliest."""
    k = min(k, max_tokens)
    if k <= 0:
        return []
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n + 1 > length:
            continue
        tail = tokens[length - n :]
        # occurrences tokens[i : i + n], ending at i + n - 1 <= L - 2
        starts = [i for i in range(length - n) if tokens[i : i + n] == tail]
        if starts:
            whole = [i for i in starts if i + n + k <= length]
            i = whole[-1] if whole else starts[0]
            return tokens[i + n : i + n + k]
    return []


def test_ngram_matches_brute_force_on_random_sequences() -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    for trial in range(400):
        vocab = rng.randint(2, 8)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 60))]
        min_n = rng.randint(1, 4)
        max_n = rng.randint(min_n, 6)
        k = rng.randint(1, 6)
        max_tokens = rng.randint(-1, 8)
        proposer = NgramProposer(min_n, max_n, k)
        want = _ngram_ref(tokens, min_n, max_n, k, max_tokens)
        msg = f"seed={seed} trial={trial} tokens={tokens} n=[{min_n},{max_n}] k={k} max_tokens={max_tokens}"
        assert proposer.propose(tokens, max_tokens) == want, msg
        assert proposer.propose(np.asarray(tokens, dtype=np.int32), max_tokens) == want, msg


def test_ngram_no_match_and_short_sequences() -> None:
    proposer = NgramProposer(1, 3, 4)
    assert proposer.propose([1, 2, 3, 4], 4) == []
    assert proposer.propose([], 4) == []
    assert proposer.propose([7], 4) == []
    assert proposer.propose([7, 7], 4) == [7]  # the occurrence at 0 is followed by the tail itself


def test_ngram_min_n_boundary() -> None:
    tokens = [1, 2, 3, 9, 2]  # only the 1-gram [2] occurs earlier
    assert NgramProposer(1, 3, 3).propose(tokens, 3) == [3, 9, 2]
    assert NgramProposer(1, 1, 3).propose(tokens, 3) == [3, 9, 2]
    assert NgramProposer(2, 3, 3).propose(tokens, 3) == []


def test_ngram_max_n_caps_the_match_and_the_latest_whole_occurrence_wins() -> None:
    # Tail 3-gram [8, 1, 2] occurs at 4..6 (then 60); tail 2-gram [1, 2] at 1..2 (then 50) and 5..6 (then 60).
    tokens = [7, 1, 2, 50, 8, 1, 2, 60, 8, 1, 2]
    assert NgramProposer(1, 3, 2).propose(tokens, 2) == [60, 8]
    assert NgramProposer(1, 2, 2).propose(tokens, 2) == [60, 8]
    assert NgramProposer(3, 5, 2).propose(tokens, 2) == [60, 8]
    assert NgramProposer(4, 5, 2).propose(tokens, 2) == []
    # Several occurrences of the longest n-gram: the latest followed by k tokens.
    assert NgramProposer(1, 2, 1).propose([1, 2, 10, 1, 2, 20, 1, 2], 3) == [20]
    assert NgramProposer(1, 2, 3).propose([1, 2, 10, 11, 12, 1, 2, 20, 1, 2], 3) == [20, 1, 2]
    # The latest is followed by 3 tokens only: the latest followed by 4.
    assert NgramProposer(1, 2, 4).propose([1, 2, 10, 11, 12, 1, 2, 20, 1, 2], 4) == [10, 11, 12, 1]
    # None followed by k tokens: the earliest.
    assert NgramProposer(1, 1, 9).propose([4, 1, 4, 2, 4], 9) == [1, 4, 2, 4]


def test_ngram_max_tokens_caps_and_sequence_end_truncates() -> None:
    tokens = [5, 1, 2, 3, 4, 6, 5]
    proposer = NgramProposer(1, 2, 3)
    assert proposer.propose(tokens, 10) == [1, 2, 3]
    assert proposer.propose(tokens, 2) == [1, 2]
    assert proposer.propose(tokens, 0) == []
    assert proposer.propose(tokens, -3) == []
    assert NgramProposer(1, 2, 5).propose([3, 4, 3, 4], 5) == [3, 4]  # ends with the sequence


def test_ngram_constructor_validation() -> None:
    for args in [(0, 2, 1), (3, 2, 1), (1, 2, 0), (-1, -1, 1)]:
        with pytest.raises(ValueError):
            NgramProposer(*args)


# ----------------------------------------------------------------------------- suffix


def _substring_counts(seqs: list[list[int]], depth: int) -> Counter[tuple[int, ...]]:
    """count[s] = occurrences of s (1 <= len(s) <= depth) across seqs."""
    counts: Counter[tuple[int, ...]] = Counter()
    for seq in seqs:
        for i in range(len(seq)):
            for j in range(i + 1, min(i + depth, len(seq)) + 1):
                counts[tuple(seq[i:j])] += 1
    return counts


class _RefTrie:
    """Brute-force continuation counts over whole sequences."""

    def __init__(self, seqs: list[list[int]], depth: int) -> None:
        self.depth = depth
        self.counts = _substring_counts(seqs, depth)
        self.counts[()] = sum(len(s) for s in seqs)
        self.children: dict[tuple[int, ...], dict[int, int]] = defaultdict(dict)
        for path, c in self.counts.items():
            if path:
                self.children[path[:-1]][path[-1]] = c

    def match(self, seq: list[int], max_match: int) -> int:
        """Longest tail suffix (length <= max_match) with a continuation; 0 if none."""
        for m in range(min(max_match, len(seq)), 0, -1):
            if m < self.depth and self.children.get(tuple(seq[len(seq) - m :])):
                return m
        return 0

    def walk(self, path: tuple[int, ...], limit: int, min_prob: float) -> tuple[list[int], float]:
        draft: list[int] = []
        prob, score = 1.0, 0.0
        while len(draft) < limit and len(path) < self.depth:
            conts = self.children.get(path)
            if not conts:
                break
            tok = min(conts, key=lambda t: (-conts[t], t))
            prob *= conts[tok] / self.counts[path]
            if prob < min_prob:
                break
            draft.append(tok)
            score += prob
            path = (*path, tok)
        return draft, score


def _suffix_ref(
    seq: list[int], finished: list[list[int]], k: int, depth: int, min_prob: float, max_tokens: int
) -> list[int]:
    limit = min(k, max_tokens)
    if limit <= 0:
        return []
    max_match = max(1, depth - k)
    best: list[int] = []
    best_score = 0.0
    own = _RefTrie([seq], depth)
    m = own.match(seq, max_match)
    if m:
        best, best_score = own.walk(tuple(seq[len(seq) - m :]), limit, min_prob)
    outputs = [o for o in finished if o]
    if outputs:
        glob = _RefTrie(outputs, depth)
        m = glob.match(seq, max_match)
        if m:
            draft, score = glob.walk(tuple(seq[len(seq) - m :]), limit, min_prob)
            if score > best_score:
                best = draft
    return best


def _expand(trie: _SuffixTrie) -> Counter[tuple[int, ...]]:
    """The abstract (substring -> count) content of a trie, checking handles and best caches."""
    out: Counter[tuple[int, ...]] = Counter()
    stack = [((), trie.root)]
    while stack:
        path, node = stack.pop()
        if node.children is not None:
            assert len(node.children) >= 2 and node.tok == -1, path  # else inline
            if node.best_count >= 0:
                cached = (node.best, node.best_count)
                node.best_count = -1
                assert node.best_child() == cached, path
        for tok, child in node.items():
            p = (*path, tok)
            if type(child) is int:
                seq = trie.tokens(child >> _POS_BITS)
                e = child & _POS_MASK
                assert tuple(seq[e - len(p) + 1 : e + 1]) == p, (p, e)
                out[p] = 1
                while len(p) < trie.depth and e + 1 < len(seq):
                    e += 1
                    p = (*p, seq[e])
                    out[p] = 1
            else:
                assert child.count >= 1, p
                out[p] = child.count
                stack.append((p, child))
    return out


def _chunks(rng: random.Random, tokens: list[int]) -> list[list[int]]:
    out, i = [], 0
    while i < len(tokens):
        n = rng.randint(1, 5)
        out.append(tokens[i : i + n])
        i += n
    return out


def test_suffix_single_request_matches_brute_force_and_from_scratch() -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    for trial in range(40):
        vocab = rng.randint(2, 6)
        depth = rng.randint(2, 8)
        k = rng.randint(1, 6)
        min_prob = rng.choice([0.0, 0.1, 0.3, 0.6])
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
        output = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        proposer = SuffixProposer(k, max_tree_depth=depth, min_token_prob=min_prob, max_cached_requests=0)
        proposer.start("r", prompt)
        seq = list(prompt)
        for chunk in _chunks(rng, output):
            proposer.extend("r", chunk)
            seq += chunk
            max_tokens = rng.randint(0, 7)
            msg = f"seed={seed} trial={trial} seq={seq} depth={depth} k={k} p={min_prob} max_tokens={max_tokens}"
            assert proposer.propose("r", max_tokens) == _suffix_ref(seq, [], k, depth, min_prob, max_tokens), msg
        msg = f"seed={seed} trial={trial} seq={seq} depth={depth}"
        trie = proposer._requests["r"].trie
        assert _expand(trie) == _substring_counts([seq], depth), msg
        assert trie.root.count == len(seq), msg
        scratch = SuffixProposer(k, max_tree_depth=depth, min_token_prob=min_prob, max_cached_requests=0)
        scratch.start("r", seq)
        assert _expand(scratch._requests["r"].trie) == _expand(trie), msg
        assert scratch.propose("r", k) == proposer.propose("r", k), msg


def test_suffix_with_global_trie_matches_brute_force() -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    for trial in range(12):
        vocab = rng.randint(2, 5)
        depth = rng.randint(2, 7)
        k = rng.randint(1, 5)
        min_prob = rng.choice([0.0, 0.1, 0.3])
        max_cached = rng.randint(0, 3)
        proposer = SuffixProposer(k, max_tree_depth=depth, min_token_prob=min_prob, max_cached_requests=max_cached)
        live: dict[str, tuple[int, list[int]]] = {}  # id -> (prompt length, sequence)
        finished: list[list[int]] = []
        for step in range(60):
            rid = f"r{rng.randrange(4)}"
            if rid not in live:
                prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]
                proposer.start(rid, prompt)
                live[rid] = (len(prompt), list(prompt))
            elif rng.random() < 0.15:
                prompt_len, seq = live.pop(rid)
                proposer.stop(rid)
                if max_cached and seq[prompt_len:]:
                    finished = [*finished, seq[prompt_len:]][-max_cached:]
                msg = f"seed={seed} trial={trial} step={step} finished={finished}"
                assert proposer.num_cached_requests == len(finished), msg
                assert _expand(proposer._global) == _substring_counts(finished, depth), msg
                assert proposer._global.root.count == sum(map(len, finished)), msg
            else:
                chunk = [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
                proposer.extend(rid, chunk)
                live[rid][1].extend(chunk)
            for other, (_, seq) in live.items():
                max_tokens = rng.randint(0, 6)
                want = _suffix_ref(seq, finished, k, depth, min_prob, max_tokens)
                msg = f"seed={seed} trial={trial} step={step} seq={seq} finished={finished} depth={depth} k={k}"
                assert proposer.propose(other, max_tokens) == want, msg


def test_suffix_frequency_ties_and_min_token_prob() -> None:
    # Tail [1, 2] occurred 3 times (with the tail): followed by 3 once and 4 once.
    prompt = [1, 2, 3, 1, 2, 4, 1, 2]
    p = SuffixProposer(3, min_token_prob=0.3)
    p.start("a", prompt)
    assert p.propose("a", 3) == [3, 1, 2]  # tie 3 vs 4: the smaller id; then the single chain
    p.start("b", [1, 2, 4, 1, 2, 3, 1, 2])  # same counts, other order of appearance
    assert p.propose("b", 3) == [3, 1, 2]
    cut = SuffixProposer(3, min_token_prob=0.34)  # 1/3 < 0.34: the walk stops at once
    cut.start("a", prompt)
    assert cut.propose("a", 3) == []
    # The more frequent continuation wins: [1, 2] -> 5 twice, 6 once.
    p.start("c", [1, 2, 5, 1, 2, 5, 1, 2, 6, 1, 2])
    assert p.propose("c", 1) == [5]
    # The running product cuts the walk part-way. Tail [9] (count 5): next 1 (3 times) -> 3/5;
    # [9, 1] (3): next 7 (twice) -> 3/5 * 2/3 = 0.4; [9, 1, 7] (2): next 9 (twice) -> 0.4;
    # [9, 1, 7, 9] (2): next 1 once, 2 once -> 0.2 (< 0.3: cut); [9, 1, 7, 9, 1] (1): 8 -> 0.2.
    seq = [9, 1, 7, 9, 1, 8, 9, 1, 7, 9, 2, 9]
    for min_prob, want in [(0.3, [1, 7, 9]), (0.15, [1, 7, 9, 1, 8]), (0.61, [])]:
        q = SuffixProposer(5, min_token_prob=min_prob)
        q.start("d", seq)
        assert q.propose("d", 5) == want, min_prob


def test_suffix_depth_bound_limits_context_and_draft() -> None:
    # depth 4, k 3: contexts of length max(1, 4 - 3) = 1, drafts of at most 4 - 1 = 3 tokens.
    p = SuffixProposer(3, max_tree_depth=4, min_token_prob=0.0)
    p.start("a", [1, 2, 3, 4, 5, 6, 1])
    assert p.propose("a", 3) == [2, 3, 4]
    q = SuffixProposer(6, max_tree_depth=4, min_token_prob=0.0)
    q.start("a", [1, 2, 3, 4, 5, 6, 1])
    assert q.propose("a", 6) == [2, 3, 4]


def test_suffix_global_trie_gets_outputs_only_and_evicts_oldest() -> None:
    p = SuffixProposer(3, max_cached_requests=2)
    p.start("a", [100, 101, 102, 103])
    p.extend("a", [7, 8, 9, 10])
    assert p.num_cached_requests == 0
    p.stop("a")
    assert p.num_cached_requests == 1
    p.start("probe", [100, 101])  # the prompt of "a" is not in the global trie
    assert p.propose("probe", 3) == []
    p.start("probe", [50, 7, 8])
    assert p.propose("probe", 3) == [9, 10]  # ends with the cached output
    p.stop("probe")  # no output tokens: nothing cached
    assert p.num_cached_requests == 1
    for rid, out in [("b", [20, 21, 22, 23]), ("c", [30, 31, 32, 33])]:
        p.start(rid, [1])
        p.extend(rid, out)
        p.stop(rid)
    assert p.num_cached_requests == 2
    p.start("probe", [7])
    assert p.propose("probe", 3) == []  # "a" was evicted
    p.start("probe", [20])
    assert p.propose("probe", 3) == [21, 22, 23]
    assert _expand(p._global) == _substring_counts([[20, 21, 22, 23], [30, 31, 32, 33]], 24)

    off = SuffixProposer(3, max_cached_requests=0)
    off.start("a", [1])
    off.extend("a", [7, 8, 9])
    off.stop("a")
    off.start("probe", [7])
    assert off.num_cached_requests == 0
    assert off.propose("probe", 3) == []


def test_suffix_unknown_ids_max_tokens_and_restart() -> None:
    p = SuffixProposer(4)
    p.extend("nope", [1, 2])
    p.stop("nope")
    assert p.propose("nope", 4) == []
    p.start("a", [1, 2, 3, 1])
    assert p.propose("a", 4) == [2, 3, 1]
    assert p.propose("a", 2) == [2, 3]
    assert p.propose("a", 0) == []
    assert p.propose("a", -1) == []
    p.start("a", [5, 6])  # replaces the old state
    assert p.propose("a", 4) == []
    p.extend("a", [5])
    assert p.propose("a", 4) == [6, 5]
    p.stop("a")
    assert p.propose("a", 4) == []
    p.stop("a")  # twice: ignored


def test_suffix_constructor_validation() -> None:
    for kwargs in [
        {"num_speculative_tokens": 0},
        {"num_speculative_tokens": 2, "max_tree_depth": 1},
        {"num_speculative_tokens": 2, "min_token_prob": -0.1},
        {"num_speculative_tokens": 2, "min_token_prob": 1.5},
        {"num_speculative_tokens": 2, "max_cached_requests": -1},
    ]:
        with pytest.raises(ValueError):
            SuffixProposer(**kwargs)  # type: ignore[arg-type]
