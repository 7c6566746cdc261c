"""bench/quickstart_variant.py: KEY=VALUE overrides become typed default-preset fields; a bad one stops in one line."""
import pytest

def _bench():
    from bench import quickstart_variant

    return quickstart_variant


def test_overrides_are_typed_preset_fields():
    over = _bench()._parse_overrides(["vocab_size=2048", "pretrain_lr=0.003", "corpus=packages:tqdm,einops",
                                      "repetition_filter=1", "jf2_lr=3e-5"])
    assert over == {"vocab_size": 2048, "pretrain_lr": 0.003, "corpus": "packages:tqdm,einops",
                    "repetition_filter": True, "jf2_lr": 3e-5}
    assert type(over["vocab_size"]) is int


@pytest.mark.parametrize("bad", ["bogus=1", "vocab_size", "eval_block_sizes=8,16"])
def test_bad_override_stops_naming_it(bad):
    with pytest.raises(SystemExit, match=f"error: '{bad}': give key=value with a scalar preset field"):
        _bench()._parse_overrides([bad])
