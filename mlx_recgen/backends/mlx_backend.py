"""The pure-MLX backend: its forms (``mlx_ops.SequentialForm``, ``mlx_chunked.ChunkedForm``,
``mlx_matrix.MatrixForm``) under one object, and ``MLXBackend.form``, the one place where the
form of a call is chosen, and the decode path of short calls (``mlx_decode.Decoder``). The
forms import their shared plumbing from ``mlx_blocks``; nothing imports this module back."""

from __future__ import annotations

import functools

from ..render.mlx_ops import MLXStep, render_mlx
from .mlx_blocks import SymbolTable
from .mlx_chunked import ChunkedForm
from .mlx_decode import Decoder
from .mlx_matrix import MatrixForm
from .mlx_ops import SequentialForm


class MLXBackend:
    name = "mlx"

    def __init__(self, rec):
        self.rec = rec
        self.table = SymbolTable(rec)
        # the whole steps, for inspection (``rec.source(..., backend="mlx")``) and the reference
        self.forward_step = render_mlx(rec.forward_program, "forward_step")
        self.backward_step = render_mlx(rec.adjoint.program, "backward_step")
        self.sequential = SequentialForm(rec, self.table)
        self._chunked = None
        self._matrix = {}  # kernel backend (None: MLX ops alone) -> MatrixForm

    @property
    def origin(self) -> dict:
        """symbol -> (kind, (tensor, component)): what each step argument is."""
        return self.table.key

    @property
    def chunked(self):
        """The chunked form (built on first use; state-affine specs only)."""
        if self._chunked is None:
            self._chunked = ChunkedForm(self.rec, self.table)
        return self._chunked

    @property
    def matrix(self):
        """The matrix form in MLX ops (built on first use; specs with the matrix form only)."""
        return self.matrix_on(None)

    def matrix_on(self, kernels=None):
        """The matrix form whose chunk products run in the kernels of the kernel backend
        ``kernels`` where they can (``backends/matrix_kernels.py``), else in MLX ops."""
        if kernels not in self._matrix:
            self._matrix[kernels] = MatrixForm(self.rec, self.table, self.rec.matrix, kernels)
        return self._matrix[kernels]

    def form(self, sizes, schedule="sequential", kernels=None):
        """The form that computes a call of these sizes under the schedule ``schedule.choose``
        picked: the one place where it is chosen."""
        if schedule == "chunked":
            return self.chunked
        if schedule == "matrix":
            return self.matrix_on(kernels)
        return self.sequential

    # -- the decode path -------------------------------------------------------------------------
    def decoder(self, sizes, out_dtype) -> Decoder:
        """The decode path of calls of these sizes (a few steps, see ``function.CallPlan``)."""
        return Decoder(self, sizes, out_dtype)

    @functools.cached_property
    def decode_step(self) -> MLXStep:
        """The whole forward step on arrays laid out state axis before lane (``Decoder``)."""
        return render_mlx(self.rec.forward_program, "decode_step", state_axis=-2)

    def forward(self, inputs, states, sizes, seg, out_dtype, schedule="sequential", kernels=None):
        return self.form(sizes, schedule, kernels).forward(inputs, states, sizes, seg, out_dtype)

    def backward(self, inputs, states, residuals, d_outputs, d_finals, sizes, seg,
                 d_residuals=None, schedule="sequential", kernels=None):
        return self.form(sizes, schedule, kernels).backward(
            inputs, states, residuals, d_outputs, d_finals, sizes, seg, d_residuals=d_residuals)
