"""The state a recurrent layer carries from one call to the next."""

from __future__ import annotations


class RecurrentCache:
    """What a recurrent layer carries between calls: chunked prefill, then decoding.

    A layer given a cache reads it at the start of the call and overwrites it at the end, so
    feeding a sequence in pieces (any lengths, ``L == 1`` for decoding) gives the outputs of one
    call on the whole sequence. Make one per layer and sequence batch with the layer's
    ``make_cache()``; it is empty until the first call.

    Attributes:
      conv: the last ``kernel_size - 1`` inputs of the layer's short causal convolution,
        ``[B, kernel_size - 1, channels]`` (``None`` before the first call, and always for a
        layer without a convolution).
      state: the recurrence's state after the tokens seen, fp32, in the layout of the layer's
        recurrence (``None`` before the first call: the recurrence starts from zeros).
      offset: the number of tokens seen.
    """

    def __init__(self):
        self.conv = None
        self.state = None
        self.offset = 0

    @property
    def empty(self) -> bool:
        """Whether no call has gone through this cache yet."""
        return self.offset == 0

    @property
    def batch_size(self) -> int | None:
        """The batch size of the sequences in this cache (``None`` while empty)."""
        for x in (self.state, self.conv):
            if x is not None:
                return x.shape[0]
        return None

    def __repr__(self):
        def shape(x):
            return None if x is None else tuple(x.shape)

        return (f"RecurrentCache(offset={self.offset}, conv={shape(self.conv)}, "
                f"state={shape(self.state)})")
