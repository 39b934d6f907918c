"""workers/runner.py forward_parts: a large CPU step's sequences in consecutive parts of whole
sequences, every token in exactly one part, in order."""

import random

from meshserve.workers.runner import forward_parts


def test_parts_cover_every_sequence_once_in_order_within_the_limit():
    rng = random.Random(0)
    for _ in range(200):
        lens = [rng.choice([1, 1, 3, 16, 64, 700]) for _ in range(rng.randint(1, 40))]
        limit = rng.choice([1, 16, 64, 100, 2048])
        parts = forward_parts(lens, limit)
        assert parts[0][0] == 0 and parts[0][2] == 0 and parts[-1][1] == len(lens) and parts[-1][3] == sum(lens)
        for (a, b, ta, tb), nxt in zip(parts, parts[1:] + [None]):
            assert a < b and tb - ta == sum(lens[a:b])
            assert tb - ta <= limit or b - a == 1  # only a sequence longer than the limit stands alone
            if nxt is not None:
                assert nxt[0] == b and nxt[2] == tb
                assert tb - ta + lens[b] > limit  # a part ends only where the next sequence does not fit


def test_examples():
    assert forward_parts([64] * 4, 128) == [(0, 2, 0, 128), (2, 4, 128, 256)]
    assert forward_parts([5, 300, 1, 1], 100) == [(0, 1, 0, 5), (1, 2, 5, 305), (2, 4, 305, 307)]
    assert forward_parts([7], 2) == [(0, 1, 0, 7)]
