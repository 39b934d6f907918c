"""Backends with narrow capabilities, registered by the registry tests through monkeypatch."""

import dataclasses

from meshserve.attention.backends.torch_ref import TorchBackend

NARROW = dataclasses.replace(
    TorchBackend.capabilities, learned_sinks=False, alibi=False, min_block_size=16, max_block_size=64,
    required_packages=(),
)


class NoSinksBackend(TorchBackend):
    name = "NOSINKS"
    capabilities = NARROW


class NeedsPackageBackend(TorchBackend):
    name = "NEEDSPKG"
    capabilities = dataclasses.replace(NARROW, required_packages=("surely_not_installed_pkg",))
