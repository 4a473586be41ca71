"""Exceptions raised by mlx-recgen, and how their messages name things."""


class SpecError(ValueError):
    """A recurrence spec is malformed.

    Raised at definition time (when ``@recurrence`` runs) with a message that names the spec,
    the offending symbol and what is wrong with it.
    """

    def __init__(self, spec: str, message: str):
        self.spec = spec
        super().__init__(f"spec '{spec}': {message}")


def dtype_name(d) -> str:
    """A dtype as messages name it: ``float32``, not ``mlx.core.float32``."""
    return str(d).replace("mlx.core.", "")
