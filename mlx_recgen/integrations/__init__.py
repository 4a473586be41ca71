"""Integrations of mlx-recgen recurrences into other MLX libraries.

Each integration is a module of its own and imports its library only when it is imported:
``mlx_recgen.integrations.mlx_lm`` (needs ``pip install mlx-recgen[mlx-lm]``).
"""
