"""FP8 training (tensorwise, rowwise and delayed scaling), as ``torchao.float8``.

- :mod:`.cast`: amax, scale and the saturating cast (``quantize``, ``sqnr``), its
  kernels in :mod:`.fp8_kernel`, run compiled on a CPU by :mod:`.compiled_cast`;
- :mod:`.config`: :class:`~amped.lowp.Float8Config` and the named configs;
- :mod:`.delayed`: delayed (amax-history) scaling state and its per-step update;
- :mod:`.gemm`: ``scaled_mm``, ``torch._scaled_mm`` or its exact emulation;
- :mod:`.linear`: :class:`~amped.lowp.Float8Linear`;
- :mod:`.fsdp_wire`: FSDP2's all-gather of weights cast to FP8.

The public names are exported by :mod:`amped.lowp`.
"""
