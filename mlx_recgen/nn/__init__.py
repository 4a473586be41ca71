"""Recurrent layers for ``mlx.nn`` models, on mlx-recgen's recurrences.

    from mlx_recgen.nn import Mamba2

    mixer = Mamba2(256, head_dim=32, state_size=64)
    y = mixer(x)                          # training: [B, L, 256] -> [B, L, 256]

    cache = mixer.make_cache()            # inference: prefill in pieces, then decode
    y = mixer(prompt, cache=cache)
    y = mixer(next_token, cache=cache)    # [B, 1, 256]

Each layer takes ``backend=`` and ``schedule=`` for its recurrence (``"auto"`` picks both per
call; ``backend="reference"`` runs the spec's plain per-step MLX loop, for comparison).
"""

from .cache import RecurrentCache
from .gated_deltanet import GatedDeltaNet
from .gla import GLA
from .mamba2 import Mamba2
from .rglru import RGLRU

__all__ = ["Mamba2", "GatedDeltaNet", "GLA", "RGLRU", "RecurrentCache"]
