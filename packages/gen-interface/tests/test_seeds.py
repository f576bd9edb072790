import torch
from gen_interface.seeds import MAX_SEED, derive_row_seeds, derive_sample_seeds, row_seed
from hypothesis import given
from hypothesis import strategies as st


def test_row_seeds_depend_only_on_the_base_and_the_row():
    assert derive_row_seeds(7, 5)[:3] == derive_row_seeds(7, 3)
    assert derive_row_seeds(7, 3) != derive_row_seeds(8, 3)
    assert len(set(derive_row_seeds(7, 100))) == 100
    assert derive_row_seeds(None, 4) != derive_row_seeds(None, 4)


@given(base=st.integers(0, MAX_SEED), count=st.integers(0, 16))
def test_sample_seeds_give_the_rows_exactly_the_derived_seeds(base, count):
    samples = derive_sample_seeds(base, count)
    assert all(0 <= s < 2**63 for s in samples)
    assert [row_seed(s) for s in samples] == derive_row_seeds(base, count)


@given(st.integers(0, MAX_SEED), st.integers(0, MAX_SEED))
def test_row_seed_is_a_bijection_of_64_bit_integers(a, b):
    assert 0 <= row_seed(a) <= MAX_SEED
    assert (row_seed(a) == row_seed(b)) == (a == b)


def test_seeds_differing_only_in_high_bits_reach_torchs_32_kept_bits():
    """torch's CPU generator keeps 32 bits of its seed: every bit of ours must reach them."""
    for gap_bits in (31, 32, 40, 62):
        low, high = 12345, 12345 + (1 << gap_bits)
        for pair in (
            [row_seed(low), row_seed(high)],
            [*derive_row_seeds(low, 1), *derive_row_seeds(high, 1)],
        ):
            first, second = (
                torch.randint(0, 2**31, (4,), generator=torch.Generator().manual_seed(s))
                for s in pair
            )
            assert not torch.equal(first, second)
