"""Exceptions raised by mlx-recgen."""


class SpecError(ValueError):
    """A recurrence spec is malformed.

    Raised at definition time (when ``@recurrence`` runs) with a message that names the spec,
    the offending symbol and what is wrong with it.
    """

    def __init__(self, spec: str, message: str):
        self.spec = spec
        super().__init__(f"spec '{spec}': {message}")
