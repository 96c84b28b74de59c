"""The GPU kernel variants' registry (csrc/gpu_variants.cpp, recxla.ops.gpu_variants): every
family lists its variants, every architecture's choice is one of them, overrides apply and are
undone, and bad names are clear errors. The kernels themselves run on a GPU only (the
campaign); this is the part every build carries."""

import pytest

from recxla.ops import gpu_variants

# Architectures recxla builds for by default and the next ones: each gets a valid choice.
CAPABILITIES = (70, 80, 86, 89, 90, 100, 120)


def test_every_family_has_variants_and_a_valid_choice():
    families = gpu_variants.families()
    assert {"fp8_quantize", "fp8_dequantize", "dedup", "cluster", "embedding_update"} <= set(families)
    for family in families:
        names = gpu_variants.variants(family)
        assert len(names) >= 2 and len(set(names)) == len(names), family
        for capability in CAPABILITIES:
            assert gpu_variants.chosen(family, capability) in names


def test_override_applies_to_every_architecture_and_is_undone():
    for family in gpu_variants.families():
        names = gpu_variants.variants(family)
        defaults = {c: gpu_variants.chosen(family, c) for c in CAPABILITIES}
        for name in names:
            with gpu_variants.use_variant(family, name):
                assert {gpu_variants.chosen(family, c) for c in CAPABILITIES} == {name}
            assert {c: gpu_variants.chosen(family, c) for c in CAPABILITIES} == defaults


def test_override_is_undone_when_the_block_raises():
    family = "dedup"
    default = gpu_variants.chosen(family, 90)
    other = next(n for n in gpu_variants.variants(family) if n != default)
    with pytest.raises(KeyError):
        with gpu_variants.use_variant(family, other):
            raise KeyError("inside")
    assert gpu_variants.chosen(family, 90) == default


def test_bad_names_are_clear_errors():
    with pytest.raises(ValueError, match="unknown op family 'fp9'; the families are"):
        gpu_variants.variants("fp9")
    with pytest.raises(ValueError, match="family 'dedup' has no variant 'bogus'; it has "):
        gpu_variants.set_variant("dedup", "bogus")
    with pytest.raises(ValueError, match="unknown op family"):
        gpu_variants.chosen("nope", 90)
