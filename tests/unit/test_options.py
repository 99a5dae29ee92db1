"""Options: validation, precedence (call > configure() > built-in)."""

from __future__ import annotations

import pytest

import cloudckpt
from cloudckpt.errors import ConfigError
from cloudckpt.options import MiB, TransferOptions, resolve_options


def test_defaults_fit_s3():
    opts = TransferOptions()
    assert (opts.part_size, opts.write_concurrency, opts.read_concurrency) == (64 * MiB, 10, 15)


@pytest.mark.parametrize(
    "bad",
    [
        {"part_size": 1024},
        {"write_concurrency": 0},
        {"read_concurrency": -1},
        {"max_attempts": 0},
        {"backoff_base": 0},
        {"requests_per_second": 0},
    ],
)
def test_bad_values_raise_config_error_naming_the_option(bad):
    name = next(iter(bad))
    with pytest.raises(ConfigError, match=name):
        TransferOptions(**bad)


def test_unknown_option_is_named():
    with pytest.raises(ConfigError, match="part_sise"):
        resolve_options(part_sise=5)


def test_call_overrides_process_defaults_which_override_builtins():
    before = cloudckpt.get_defaults()
    try:
        cloudckpt.configure(write_concurrency=4)
        assert resolve_options().write_concurrency == 4
        assert resolve_options(write_concurrency=2).write_concurrency == 2
        assert resolve_options().part_size == 64 * MiB
    finally:
        cloudckpt.configure(**{f: getattr(before, f) for f in ("write_concurrency",)})
    assert resolve_options().write_concurrency == before.write_concurrency
